"""Models that derive their positions from the 2-D mask themselves: OPT (its learned table indexed by the
mask's cumsum, or by the caller's positions) and BLOOM (ALiBi built from the mask's cumsum). Padding and
padded cached prefixes are right on stock, so hfpatch derives nothing for them; a row that packs several
sequences (positions restarting) lets each see the ones before it on stock, and a mask by sequence keeps it
to its own (BLOOM's ALiBi then reads the 2-D mask it was built from: ``hands_to="alibi"``). Each from the
first release where the class is the one patched (OPT's decoder takes positions from 4.46); their packed
rows are kept where their mask code takes a 4-D mask (BLOOM 4.44+, OPT 4.49+; before, declared and
warned, as for any model)."""

from ..declarations import ALIBI, Adapter, Family

FROM_MASK = (
    (">=4.0", "right on stock with padding (it derives positions from the mask itself): hfpatch keeps its packed rows only"),
)  # fmt: skip
OWN_TABLE = Family("absolute, from the mask", from_mask=True, notes=FROM_MASK)
OWN_ALIBI = Family(
    "alibi, from the mask", from_mask=True, hands_to=ALIBI, position_module="", notes=FROM_MASK
)

# fmt: off
ADAPTERS = (
    Adapter("bloom", "BloomModel", OWN_ALIBI, "4.28", receiver="BloomModel"),
    Adapter("opt", "OPTDecoder", OWN_TABLE, "4.46"),
)
# fmt: on
