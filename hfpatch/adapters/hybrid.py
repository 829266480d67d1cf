"""Models whose layers carry a state from token to token besides attending: a causal convolution, an SSM
(Mamba, Mamba2), a gated delta rule (Qwen3.5, Qwen3-Next, OLMo hybrid), a linear or lightning attention
(Kimi Linear, Bailing, MiniMax). Their attention (RoPE, or none) takes positions as any decoder's; the
layers that carry a state are found by their code and run each call's sequences alone
(:mod:`hfpatch.mixers`), so that pads, a padded cached prefix and a packed row's earlier sequences never
reach a sequence's state. One line per patched class, as in :mod:`hfpatch.adapters.rotary`."""

from ..declarations import Adapter, Family
from .rotary import ROTARY

STATE = Family("state", attends=False)  # no attention at all: no positions, no masks
ALL = ">=4.0"  # (Adapter.steps: on every release)

# models whose layers carry a state from token to token besides attending (hfpatch.mixers runs those layers
# by sequence; their attention, RoPE or none, takes positions as any decoder's)
# fmt: off
ADAPTERS = (
    Adapter("bailing_hybrid", "BailingHybridModel", ROTARY, "5.24"),
    Adapter("bamba", "BambaModel", ROTARY, "5.24", steps=">=5.5,<5.13"),
    Adapter("falcon_h1", "FalconH1Model", ROTARY, "5.24", steps="<5.13"),
    Adapter("granitemoehybrid", "GraniteMoeHybridModel", ROTARY, "5.24", steps="<5.13"),
    Adapter("jamba", "JambaModel", ROTARY, "5.24", steps=ALL),
    Adapter("kimi_linear", "KimiLinearModel", ROTARY, "5.24"),
    Adapter("lara_mini", "LaraMiniModel", ROTARY, "5.24"),
    Adapter("lfm2", "Lfm2Model", ROTARY, "5.24", steps="<5.15"),
    Adapter("lfm2_moe", "Lfm2MoeModel", ROTARY, "5.24", steps="<5.15"),
    Adapter("lfm3", "Lfm3Model", ROTARY, "5.24"),
    Adapter("mamba", "MambaModel", STATE, "5.24", steps=ALL),
    Adapter("mamba2", "Mamba2Model", STATE, "5.24"),
    Adapter("falcon_mamba", "FalconMambaModel", STATE, "5.24", steps=ALL),
    Adapter("nemotron_h", "NemotronHModel", ROTARY, "5.24", steps="<5.15"),
    Adapter("minimax", "MiniMaxModel", ROTARY, "5.15"),
    Adapter("olmo_hybrid", "OlmoHybridModel", ROTARY, "5.24", steps="<5.7"),
    Adapter("qwen3_5_text", "Qwen3_5TextModel", ROTARY, "5.24", package="qwen3_5", aliases=("qwen3_5",), steps="<5.7"),
    Adapter("qwen3_5_moe_text", "Qwen3_5MoeTextModel", ROTARY, "5.24", package="qwen3_5_moe", aliases=("qwen3_5_moe",), steps="<5.7"),
    Adapter("qwen3_next", "Qwen3NextModel", ROTARY, "5.24", steps="<5.7"),
    Adapter("qwen4_exp_text", "Qwen4ExpTextModel", ROTARY, "5.24", package="qwen4_exp", aliases=("qwen4_exp",)),
    Adapter("zamba", "ZambaModel", ROTARY, "5.24", steps=ALL),
    Adapter("zamba2", "Zamba2Model", ROTARY, "5.24", steps="<5.15"),
    Adapter("zaya", "ZayaModel", ROTARY, "5.24"),
)
# fmt: on
