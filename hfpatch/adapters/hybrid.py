"""Models whose layers carry a state from token to token besides attending: a causal convolution, an SSM
(Mamba, Mamba2), a gated delta rule (Qwen3.5, Qwen3-Next, OLMo hybrid), a linear or lightning attention
(Kimi Linear, Bailing, MiniMax). Their attention (RoPE, or none) takes positions as any decoder's; the
layers that carry a state are found by their code and run each call's sequences alone
(:mod:`hfpatch.mixers`), so that pads, a padded cached prefix and a packed row's earlier sequences never
reach a sequence's state. RWKV's and xLSTM's layers are handed the state itself (no cache object): the same
mechanism gives each sequence its own rows of it. Each from the first release where the probe finds it
exact (compat/REPORT.md). One line per patched class, as in :mod:`hfpatch.adapters.rotary`."""

from ..declarations import Adapter, Family
from .rotary import ROTARY

STATE = Family("state", attends=False)  # no attention at all: no positions, no masks
ALL = ">=4.0"  # (Adapter.steps: on every release)
# releases whose stock call of the tiny model fails (no evidence either way: not patched there)
ZAMBA2_50 = (
    "a plain call of its tiny model fails on stock there ('Zamba2Model' has no rotary_emb): not verified"
)

# models whose layers carry a state from token to token besides attending (hfpatch.mixers runs those layers
# by sequence; their attention, RoPE or none, takes positions as any decoder's)
# fmt: off
ADAPTERS = (
    Adapter("bailing_hybrid", "BailingHybridModel", ROTARY, "5.20"),
    Adapter("bamba", "BambaModel", ROTARY, "4.48", steps=">=5.5,<5.13"),
    Adapter("falcon_h1", "FalconH1Model", ROTARY, "4.53", steps="<5.13"),
    Adapter("granitemoehybrid", "GraniteMoeHybridModel", ROTARY, "4.52", steps="<5.13"),
    Adapter("jamba", "JambaModel", ROTARY, "4.40", steps=ALL),
    Adapter("kimi_linear", "KimiLinearModel", ROTARY, "5.17"),
    Adapter("lara_mini", "LaraMiniModel", ROTARY, "5.24"),
    Adapter("lfm2", "Lfm2Model", ROTARY, "4.56", steps="<5.15"),
    Adapter("lfm2_moe", "Lfm2MoeModel", ROTARY, "5.0", steps="<5.15"),
    Adapter("lfm3", "Lfm3Model", ROTARY, "5.23"),
    Adapter("mamba", "MambaModel", STATE, "4.45", steps=ALL),
    Adapter("mamba2", "Mamba2Model", STATE, "4.48", steps="<5.13"),
    Adapter("falcon_mamba", "FalconMambaModel", STATE, "4.45", steps=ALL),
    Adapter("nemotron_h", "NemotronHModel", ROTARY, "5.3", steps="<5.15"),
    Adapter("minimax", "MiniMaxModel", ROTARY, "4.56"),
    Adapter("olmo_hybrid", "OlmoHybridModel", ROTARY, "5.3", steps="<5.7"),
    Adapter("qwen3_5_text", "Qwen3_5TextModel", ROTARY, "5.2", package="qwen3_5", aliases=("qwen3_5",), alias_since=(("qwen3_5", "5.8"),), steps="<5.7"),
    Adapter("qwen3_5_moe_text", "Qwen3_5MoeTextModel", ROTARY, "5.2", package="qwen3_5_moe", aliases=("qwen3_5_moe",), alias_since=(("qwen3_5_moe", "5.8"),), steps="<5.7"),
    Adapter("qwen3_next", "Qwen3NextModel", ROTARY, "4.57", steps="<5.7"),
    Adapter("rwkv", "RwkvModel", STATE, "4.30"),
    Adapter("xlstm", "xLSTMModel", STATE, "4.54"),
    Adapter("qwen4_exp_text", "Qwen4ExpTextModel", ROTARY, "5.16", package="qwen4_exp", aliases=("qwen4_exp",)),
    Adapter("zamba", "ZambaModel", ROTARY, "4.46", steps=ALL),
    Adapter("zamba2", "Zamba2Model", ROTARY, "4.49", steps="<5.15", unverified=((">=5.0,<5.4", ZAMBA2_50),)),
    Adapter("zaya", "ZayaModel", ROTARY, "5.13"),
)
# fmt: on
