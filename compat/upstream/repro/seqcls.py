# Standalone: sequence classification pools a masked position when pads' ids != config.pad_token_id (real defect).
import torch, hfpatch
hfpatch.apply()
from transformers import LlamaConfig, LlamaForSequenceClassification
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, num_labels=3)
m = LlamaForSequenceClassification(cfg).eval()
ids = torch.randint(3, 99, (4, 8))                  # no id equals pad_token_id (0)
mask = torch.ones_like(ids); mask[0, 3:] = 0; mask[1, 5:] = 0; mask[2, 2:] = 0   # right padding
labels = torch.tensor([0, 1, 2, 1])
for unpad in (False, True):
    hfpatch.apply(unpad=unpad)
    with torch.no_grad():
        o = m(input_ids=ids, attention_mask=mask, labels=labels)
    print(f"unpad={unpad}: loss {o.loss.item():.6f} logits[0] {o.logits[0].tolist()}")
# with the pads' ids set to pad_token_id, as a tokenizer pads: both the same
ids2 = ids.masked_fill(mask == 0, 0)
for unpad in (False, True):
    hfpatch.apply(unpad=unpad)
    with torch.no_grad():
        o = m(input_ids=ids2, attention_mask=mask, labels=labels)
    print(f"pads=pad_token_id unpad={unpad}: loss {o.loss.item():.6f}")
