# Run from the test tree ($WORK/tree). # BloomModelTest::test_bloom_model_past_large_inputs, compared at real tokens and at pads
import sys; sys.path.insert(0, "."); import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shims"))
import torch, hfpatch
hfpatch.apply()
import upstream_shims
from tests.models.bloom.test_modeling_bloom import BloomModelTest
from tests.test_modeling_common import ids_tensor
from transformers import BloomModel
case = BloomModelTest("setUp"); case.setUp()
config, input_ids, _, input_mask, *_ = case.model_tester.prepare_config_and_inputs()
torch.manual_seed(0)
model = BloomModel(config).eval()
next_tokens = ids_tensor((13, 3), config.vocab_size); next_mask = ids_tensor((13, 3), vocab_size=2)
nxt_ids = torch.cat([input_ids, next_tokens], -1); nxt_mask = torch.cat([input_mask, next_mask], -1)
res = {}
for unpad in (False, True):
    hfpatch.apply(unpad=unpad)
    with torch.no_grad():
        out, past = model(input_ids, attention_mask=input_mask, use_cache=True).to_tuple()
        no_past = model(nxt_ids, attention_mask=nxt_mask)["last_hidden_state"][:, -3:]
        with_past = model(next_tokens, attention_mask=nxt_mask, past_key_values=past)["last_hidden_state"]
    res[unpad] = (no_past, with_past)
hfpatch.apply(unpad=False)
real = next_mask.bool()
for unpad in (False, True):
    a, b = res[unpad]
    d = (a - b).abs()
    print(f"unpad={unpad}: no_past vs past: real max {d[real].max():.2e}, pads max {d[~real].max():.2e}")
for i, name in enumerate(("no_past", "past")):
    d = (res[False][i] - res[True][i]).abs()
    print(f"{name}: unpad=False vs True: real max {d[real].max():.2e}, pads max {d[~real].max():.2e}")
print(hfpatch.status().unpadded)
