# OPTModelTest::test_decoder_model_past_with_large_inputs with a next mask that unpads (> 15 % pads), at real tokens and at pads. Run from the test tree ($WORK/tree).
import sys; sys.path.insert(0, "."); import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shims"))
import torch, hfpatch
hfpatch.apply()
import upstream_shims
from tests.models.opt.test_modeling_opt import OPTModelTest
from tests.test_modeling_common import ids_tensor
from transformers import OPTModel
case = OPTModelTest("setUp"); case.setUp()
config, inputs = case.model_tester.prepare_config_and_inputs()
ids, mask = inputs["input_ids"], inputs["attention_mask"]
torch.manual_seed(0); model = OPTModel(config).eval()
bs = ids.shape[0]
import random
for s in range(100):
    random.seed(s); nm = ids_tensor((bs, 3), 2)
    if int(nm.numel() - nm.sum()) + int(mask.numel() - mask.sum()) > 0.15 * (mask.numel() + nm.numel()): break
nt = ids_tensor((bs, 3), config.vocab_size)
nids = torch.cat([ids, nt], -1); nmask = torch.cat([mask, nm], -1)
print("first mask real", int(mask.sum()), "of", mask.numel(), "; next mask real", int(nmask.sum()), "of", nmask.numel())
res = {}
for unpad in (False, True):
    hfpatch.apply(unpad=unpad)
    with torch.no_grad():
        _, past = model(ids, attention_mask=mask, use_cache=True).to_tuple()
        a = model(nids, attention_mask=nmask)["last_hidden_state"][:, -3:]
        b = model(nt, attention_mask=nmask, past_key_values=past)["last_hidden_state"]
    res[unpad] = (a, b)
hfpatch.apply(unpad=False)
real = nm.bool()
for unpad in (False, True):
    d = (res[unpad][0] - res[unpad][1]).abs()
    print(f"unpad={unpad}: no_past vs past, last 3 columns: real max {d[real].max():.2e}, pads max {d[~real].max():.2e}")
