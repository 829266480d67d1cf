"""What a declaration is: a :class:`Family` (what really differs between architectures), an
:class:`Adapter` (one patched class, one short line in ``hfpatch/adapters/``) and an
:class:`Undeclared` model type (known, not patched, and why). The engine does every check, install,
revert and report for all of them alike."""

from __future__ import annotations

from typing import NamedTuple, Optional

from .support import NEWEST_TESTED

__all__ = [
    "NOT_COVERED",
    "NOT_FIXABLE",
    "ALIBI",
    "PADDED_TABLE",
    "RELATIVE_BIAS",
    "RIGHT_ON_STOCK",
    "SINUSOID",
    "TABLE",
    "THROUGH_LANGUAGE_MODEL",
    "Adapter",
    "Family",
    "Undeclared",
    "kept",
    "why_not",
]

# where a family's positions go when the patched forward takes none (Family.hands_to; hfpatch.decoders)
TABLE, SINUSOID, PADDED_TABLE, RELATIVE_BIAS = "table", "sinusoid", "padded table", "relative bias"
ALIBI = "alibi"  # ALiBi built from the 2-D mask (BLOOM): the mask, when the model is given a 4-D one


class Family(NamedTuple):
    """What architectures of one kind share: how positions enter the model, and the facts that follow.

    Attributes:
        name: ``"absolute"`` (a learned or fixed table indexed by position: left padding shifts every
            real token on stock) or ``"rotary"`` (RoPE and relatives: a uniform left shift cancels,
            the holes of a padded cached prefix do not).
        attached_cache: attribute path from the base model to a static cache kept outside the
            forward's arguments (4.38-4.40 ``model._setup_cache``), read only to find cache slots.
        notes: (releases, what positions leave wrong there): shown by ``status()`` on those releases.
        hands_to: where the positions go when the patched ``forward`` takes none (the decoders and
            encoders of encoder-decoder models, :mod:`hfpatch.decoders`): ``"table"`` (a position
            table's lookup), ``"sinusoid"`` (a sinusoid computed from positions),
            ``"padded table"`` (a table indexed past the pad id, M2M100-style), ``"relative
            bias"`` (T5-style buckets, per row) or ``"alibi"`` (the 2-D mask, for ALiBi built from it
            where the model is given a 4-D mask: BLOOM). ``None``: the forward takes ``position_ids``.
        position_module: the attribute of the patched class that holds its position module (the one
            instance that takes this call's positions; ``""``: the patched module itself); ``None`` for
            the relative bias, computed by every attention layer of the call that has one.
        seq2seq: inside an encoder-decoder model (its decoder, or its encoder): ``verify()`` and the
            release probe run it on the tiny encoder-decoder model (``hfpatch.tiny.tiny_seq2seq``), and
            ``tests/test_decoders.py`` checks it against its own reference.
        ids_rank: the rank of the patched forward's ``input_ids``: 3 for ``[batch, tokens, channels]``
            audio codes (Dia), whose forward takes no ``inputs_embeds``.
        attends: False for a model without attention (Mamba, Mamba2: only layers that carry a state): its
            forward takes no positions and no masks; its state layers keep a padded or packed call's
            sequences apart (:mod:`hfpatch.mixers`).
        from_mask: the forward derives its positions from the 2-D mask itself (OPT: the mask's cumsum;
            BLOOM: ALiBi from it), so stock is right with padding and hfpatch derives nothing; it keeps a
            packed row (positions restarting) to its sequences.
        multimodal: the text path of an image-text-to-text model that is no causal LM of its own
            (PaliGemma's wrapper, the text model of Qwen2-VL ...): ``verify()`` and the release probe
            leave it to ``tests/test_wrappers.py``; windows stay transformers' (the wrapper builds the
            masks, or hands the 2-D mask to a text model that applies its own).
    """

    name: str
    attached_cache: Optional[str] = None
    notes: tuple[tuple[str, str], ...] = ()
    hands_to: Optional[str] = None
    position_module: Optional[str] = None
    seq2seq: bool = False
    ids_rank: int = 2
    multimodal: bool = False
    from_mask: bool = False
    attends: bool = True


class Adapter(NamedTuple):
    """One patched class, declared as data.

    Attributes:
        arch: the model type (``config.model_type``), used by ``apply(archs=[...])`` and ``status()``.
        cls: the class whose own ``forward`` is replaced (the base model, or a multimodal wrapper's).
        family: see :class:`Family`.
        since: the first release of the tested range, which runs through :data:`NEWEST_TESTED`.
        package: the ``transformers.models`` package, when it is not ``arch`` with ``_`` for ``-``.
        aliases: other model types whose models run this very class (``exaone`` runs ``LlamaModel``).
        alias_since: (alias, release): an alias verified from a later release than the class (a
            multimodal wrapper whose tiny config builds only there); ``status()`` says so before it.
        limits: what positions cannot fix inside "applied" (Llama 4's NoPE layers ...), shown by
            ``verify``.
        eager_mask: (releases, attribute): on these releases the model's SDPA mask code mishandles a
            padded cached prefix continued by several tokens (4.36-4.37 ``_unmask_unattended``); for
            such calls, when hfpatch derives the positions, the base model's boolean ``attribute``
            (``_use_sdpa``) reads False in the calling thread, so that transformers builds its eager
            4-D mask (right for any padding; attention still runs in SDPA).
        known_bad: (releases, what is wrong there and the workaround): measured wrong upstream with
            the right positions (or failing on stock), so never patched there.
        unverified: (releases, why): releases without evidence either way (hfpatch's tiny model of the
            type cannot be built or run there): not patched unless ``apply(..., ignore_ranges=True)``.
        receiver: where ``family.hands_to`` is set, the class of the module that takes the positions
            (its position module, or the attention class whose ``compute_bias`` is made per row),
            patched with the adapter.
        also: other classes of the module whose ``forward`` gets the same patch (the encoder of a
            seq2seq model, whose absolute positions are wrong under left padding on stock).
        wrong_with: (attention, releases, why): with this attention on these releases the model is wrong
            even with the right positions, on stock alike: a limit ``verify`` shows, and the attention
            hfpatch's own checks do not build a tiny model of the type with (``verify TYPE``).
        packed: what ``status()`` says of a row that packs several sequences (positions that restart)
            where the class's mask code does not decide it, measured by the release probe: ``"no: why"``
            (recurrent or linear-attention layers carry their state across the sequences; layers that
            take no mask by sequence), or ``"yes: how"`` (a wrapper whose language model keeps them).
        steps: the releases (a spec, ``">=4.57"``) where its layers that carry a state (:mod:`hfpatch.mixers`)
            restart it in a cached call of several tokens (transformers' own multi-token path ignores the
            cached state; its one-token step keeps it): there hfpatch runs such a call's state layers one
            token at a time.
        source: the module of a class outside transformers (:mod:`hfpatch.custom`), else None.
        recognised: for such a class, how it was recognised (then its check on a tiny copy decides,
            not a release range).
    """

    arch: str
    cls: str
    family: Family
    since: str
    package: Optional[str] = None
    aliases: tuple[str, ...] = ()
    alias_since: tuple[tuple[str, str], ...] = ()
    limits: tuple[str, ...] = ()
    eager_mask: Optional[tuple[str, str]] = None
    known_bad: tuple[tuple[str, str], ...] = ()
    unverified: tuple[tuple[str, str], ...] = ()
    receiver: Optional[str] = None
    also: tuple[str, ...] = ()
    wrong_with: tuple[tuple[str, str, str], ...] = ()
    packed: Optional[str] = None
    steps: str = ""
    source: Optional[str] = None
    recognised: str = ""

    @property
    def module(self) -> str:
        if self.source is not None:
            return self.source
        package = self.package or self.arch.replace("-", "_")
        return f"transformers.models.{package}.modeling_{package}"

    @property
    def target(self) -> str:
        return f"{self.module}:{self.cls}.forward"

    @property
    def versions(self) -> str:
        return "" if self.recognised else f">={self.since},<={NEWEST_TESTED}"


RIGHT_ON_STOCK = "right on stock"
NOT_FIXABLE = "not fixable by positions"
NOT_COVERED = "not covered"
# a multimodal or speech wrapper whose language model is a class hfpatch patches (llava runs LlamaModel)
THROUGH_LANGUAGE_MODEL = "through its language model"


def kept(said: str) -> bool:
    """Whether an answer on packed rows (``Adapter.packed``'s, or ``status()``'s ``packed``: ``"yes ..."``
    or ``"no: why"``) says they are kept to their sequences: the one reading of one."""
    return said.startswith("yes")


def why_not(said: str) -> str:
    """The reason an answer on packed rows gives (``"no: why"`` -> ``why``)."""
    return said.removeprefix("no: ")


class Undeclared(NamedTuple):
    """A model type hfpatch knows and does not patch itself: ``right on stock``, ``not fixable by
    positions``, ``not covered``, or ``through its language model`` (a wrapper whose language model is
    a patched class), and why (measured on the newest tested release); ``language_model``: the adapter
    that patches its language model, where it runs through one (its packed rows are that one's);
    ``packed``: what ``status()`` says of its packed rows, where declared."""

    arch: str
    verdict: str
    reason: str
    language_model: Optional[str] = None
    packed: str = ""
