# Standalone: a right-padded generate(logits_to_keep=0) under unpad=True picks token 0 from a pad's zero logits.
import torch, hfpatch
hfpatch.apply()
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
m = LlamaForCausalLM(LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None)).eval()
ids = torch.randint(3, 99, (2, 7)); mask = torch.tril(torch.ones(7, 7, dtype=torch.long))[:2]   # right padding
for unpad in (False, True):
    hfpatch.apply(unpad=unpad)
    for keep in (0, None):
        kw = {} if keep is None else {"logits_to_keep": keep}
        out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **kw)
        print(f"unpad={unpad} logits_to_keep={keep}: new tokens {out[:, 7:].tolist()}")
