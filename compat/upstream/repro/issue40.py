# Standalone: the issue-40 list (config output_attentions, return_dict=False, hidden-state grads, QA / token-classification / LM losses, router logits).
import torch, hfpatch
hfpatch.apply()
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForQuestionAnswering, LlamaForTokenClassification, MixtralConfig, MixtralForCausalLM
torch.manual_seed(0)
kw = dict(vocab_size=99, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
ids = torch.randint(3, 99, (13, 7)); mask = torch.tril(torch.ones_like(ids))
def both(f):
    out = {}
    for u in (False, True):
        hfpatch.apply(unpad=u); out[u] = f()
    hfpatch.apply(unpad=False); return out
# 1 config output_attentions
cfg = LlamaConfig(**kw, attn_implementation="eager"); cfg.output_attentions = True
m = LlamaForCausalLM(cfg).eval()
o = both(lambda: m(input_ids=ids, attention_mask=mask).attentions[0].shape); print("config attentions", o)
# 2 return_dict=False
m = LlamaForCausalLM(LlamaConfig(**kw)).eval()
o = both(lambda: [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in m(input_ids=ids, attention_mask=mask, return_dict=False)]); print("return_dict=False", o)
# 3 hidden states with grad
def hs():
    out = m(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    h = out.hidden_states[1]; h.retain_grad(); out.logits[mask.bool()].sum().backward()
    return h.grad is not None
print("hidden grad", both(hs))
# 4 QA loss
qa = LlamaForQuestionAnswering(LlamaConfig(**kw)).eval()
sp = torch.randint(0, 7, (13,)); ep = torch.randint(0, 7, (13,))
print("qa loss", both(lambda: round(qa(input_ids=ids, attention_mask=mask, start_positions=sp, end_positions=ep).loss.item(), 6)))
# 5 token classification with labels at real tokens only
tc = LlamaForTokenClassification(LlamaConfig(**kw, num_labels=3)).eval()
lab = torch.randint(0, 3, ids.shape).masked_fill(mask == 0, -100)
print("tokcls loss (labels -100 at pads)", both(lambda: round(tc(input_ids=ids, attention_mask=mask, labels=lab).loss.item(), 6)))
lab2 = torch.randint(0, 3, ids.shape)
print("tokcls loss (labels at pads)", both(lambda: round(tc(input_ids=ids, attention_mask=mask, labels=lab2).loss.item(), 6)))
# 6 causal lm loss with labels -100 at pads
lm = LlamaForCausalLM(LlamaConfig(**kw)).eval()
lab = ids.masked_fill(mask == 0, -100)
print("lm loss", both(lambda: round(lm(input_ids=ids, attention_mask=mask, labels=lab).loss.item(), 6)))
# 7 router logits
mx = MixtralForCausalLM(MixtralConfig(**kw, num_local_experts=4, num_experts_per_tok=2)).eval()
print("router keyword", both(lambda: tuple(mx(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits[0].shape)))
mxc = MixtralConfig(**kw, num_local_experts=4, num_experts_per_tok=2); mxc.output_router_logits = True
mx = MixtralForCausalLM(mxc).eval()
print("router config", both(lambda: (tuple(mx(input_ids=ids, attention_mask=mask).router_logits[0].shape), round(float(mx(input_ids=ids, attention_mask=mask, labels=lab).aux_loss),6))))
print(hfpatch.status().unpadded)
