"""Activation sites: names, validation, and where they live in a decoder.

A *site* is a place in a decoder-only transformer where skafa reads the hidden
state of a token. Three kinds exist, named as in the shared API contract:

``resid_pre.{l}``
    The residual stream entering decoder layer ``l`` (the input of layer ``l``;
    for ``l = 0`` this is the output of the embedding module, which for Gemma
    already includes the ``sqrt(hidden_size)`` scale).
``mlp_in.{l}``
    What layer ``l``'s MLP reads: the output of the norm whose output feeds the
    MLP. See :func:`decoder_layout` for which module that is in each family.
``resid_final``
    The output of the decoder's final norm (what the LM head would read).
``head_attn.{l}``
    Not a hidden state: the attention of each of layer ``l``'s heads from the
    prompt's answer position to each turn (one feature per head; see
    :class:`~skafa.llm.TurnActivationTransformer`). Never part of ``"all"``;
    ``"head_attn"`` names the sites of every layer (:func:`head_attention_sites`).

The canonical order is depth order, ``resid_pre.0, mlp_in.0, resid_pre.1, ...,
mlp_in.{L-1}, resid_final`` — ``2 * n_layers + 1`` sites (61 for SmolLM2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "all_sites",
    "stride_sites",
    "parse_site",
    "validate_sites",
    "head_attention_sites",
    "is_head_attention_site",
    "parse_site_spec",
    "site_depth",
    "DecoderLayout",
    "decoder_layout",
]

_SITE_RE = re.compile(r"^(resid_pre|mlp_in|head_attn)\.(0|[1-9][0-9]*)$")

#: The spec string naming the head-attention sites of every layer.
_HEAD_ATTN = "head_attn"


def all_sites(n_layers):
    """Return every site of a decoder with ``n_layers`` layers, in depth order.

    Parameters
    ----------
    n_layers : int
        Number of decoder layers (``config.num_hidden_layers``).

    Returns
    -------
    sites : list of str
        ``["resid_pre.0", "mlp_in.0", ..., "resid_pre.{L-1}", "mlp_in.{L-1}",
        "resid_final"]``, length ``2 * n_layers + 1``.

    Examples
    --------
    >>> all_sites(2)
    ['resid_pre.0', 'mlp_in.0', 'resid_pre.1', 'mlp_in.1', 'resid_final']
    """
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        try:
            import numpy as np

            if isinstance(n_layers, np.integer) and n_layers >= 1:
                n_layers = int(n_layers)
            else:
                raise TypeError
        except TypeError:
            raise ValueError(f"n_layers must be a positive int, got {n_layers!r}.") from None
    sites = []
    for layer in range(n_layers):
        sites.append(f"resid_pre.{layer}")
        sites.append(f"mlp_in.{layer}")
    sites.append("resid_final")
    return sites


def stride_sites(n_layers, stride):
    """Every ``stride``-th ``resid_pre`` layer from layer 0, then ``resid_final``.

    The site set the pre-registered comparison searches (``"stride:3"``: 11
    sites on SmolLM2's 30 layers, 9 on Qwen2.5-0.5B's 24, 7 on Gemma-3-270M's
    18). ``validate_sites`` accepts the spec string ``"stride:K"`` for it.

    Parameters
    ----------
    n_layers : int
        Number of decoder layers.
    stride : int
        Keep layers ``0, stride, 2 * stride, ...`` (``>= 1``).

    Returns
    -------
    sites : list of str

    Examples
    --------
    >>> stride_sites(7, 3)
    ['resid_pre.0', 'resid_pre.3', 'resid_pre.6', 'resid_final']
    """
    all_sites(n_layers)  # validates n_layers
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride must be an int >= 1, got {stride!r}.")
    return [f"resid_pre.{layer}" for layer in range(0, int(n_layers), stride)] + [
        "resid_final"]


def head_attention_sites(n_layers):
    """The head-attention site of every layer, in depth order.

    Parameters
    ----------
    n_layers : int
        Number of decoder layers.

    Returns
    -------
    sites : list of str
        ``["head_attn.0", ..., "head_attn.{L-1}"]``.

    Examples
    --------
    >>> head_attention_sites(3)
    ['head_attn.0', 'head_attn.1', 'head_attn.2']
    """
    all_sites(n_layers)  # validates n_layers
    return [f"head_attn.{layer}" for layer in range(int(n_layers))]


def is_head_attention_site(name):
    """Whether ``name`` is a head-attention site (``head_attn.{l}``).

    Parameters
    ----------
    name : str

    Returns
    -------
    bool
        ``False`` for hidden-state sites and for anything that is not a site name.
    """
    return isinstance(name, str) and _SITE_RE.match(name) is not None and name.startswith(
        _HEAD_ATTN + ".")


def _parse_stride(spec):
    """``"stride:K"`` -> ``K`` (an int >= 1); ``None`` for any other string."""
    if not spec.startswith("stride:"):
        return None
    text = spec.split(":", 1)[1].strip()
    if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
        raise ValueError(f"sites={spec!r}: the stride must be an integer >= 1.")
    return int(text)


def parse_site(name):
    """Split a site name into its kind and layer.

    Parameters
    ----------
    name : str
        A site name such as ``"resid_pre.3"``, ``"mlp_in.0"`` or ``"resid_final"``.

    Returns
    -------
    kind : {"resid_pre", "mlp_in", "resid_final", "head_attn"}
    layer : int or None
        The layer index; ``None`` for ``resid_final``.

    Raises
    ------
    ValueError
        If ``name`` is not a valid site name (the message lists the valid forms).

    Examples
    --------
    >>> parse_site("mlp_in.12")
    ('mlp_in', 12)
    >>> parse_site("resid_final")
    ('resid_final', None)
    """
    if not isinstance(name, str):
        raise ValueError(f"A site name must be a string, got {type(name).__name__} {name!r}.")
    if name == "resid_final":
        return "resid_final", None
    match = _SITE_RE.match(name)
    if match is None:
        raise ValueError(
            f"Unknown site {name!r}: valid sites are 'resid_pre.<layer>', "
            "'mlp_in.<layer>', 'resid_final' and 'head_attn.<layer>'."
        )
    return match.group(1), int(match.group(2))


def site_depth(name):
    """Sort key putting sites in canonical depth order.

    ``resid_pre.l`` -> ``2*l``, ``head_attn.l`` -> ``2*l + 0.5`` (the attention
    of layer ``l`` runs between its input and its MLP), ``mlp_in.l`` -> ``2*l + 1``,
    ``resid_final`` -> infinity-like (larger than any layer).

    Parameters
    ----------
    name : str
        A valid site name.

    Returns
    -------
    depth : int or float
    """
    kind, layer = parse_site(name)
    if kind == "resid_final":
        return float("inf")
    if kind == _HEAD_ATTN:
        return 2 * layer + 0.5
    return 2 * layer + (1 if kind == "mlp_in" else 0)


def validate_sites(sites, n_layers):
    """Check site names against a decoder with ``n_layers`` layers.

    Parameters
    ----------
    sites : None, str, or sequence of str
        ``None`` or ``"all"`` means every site (:func:`all_sites`);
        ``"stride:K"`` means :func:`stride_sites` ``(n_layers, K)``;
        ``"head_attn"`` means :func:`head_attention_sites` ``(n_layers)``. A single
        site name is accepted as a one-element list. ``head_attn.<l>`` sites are
        valid for ``l`` in range but never part of ``"all"``.
    n_layers : int
        Number of decoder layers.

    Returns
    -------
    sites : tuple of str
        The sites, in the order given (``None``/``"all"``: depth order).

    Raises
    ------
    ValueError
        Naming every unknown or out-of-range site and any duplicate; an empty list
        is refused.

    Examples
    --------
    >>> validate_sites(["resid_final", "mlp_in.1"], n_layers=2)
    ('resid_final', 'mlp_in.1')
    """
    valid = all_sites(n_layers)
    if sites is None or (isinstance(sites, str) and sites == "all"):
        return tuple(valid)
    if isinstance(sites, str):
        stride = _parse_stride(sites)
        if stride is not None:
            return tuple(stride_sites(n_layers, stride))
        if sites == _HEAD_ATTN:
            return tuple(head_attention_sites(n_layers))
        sites = [sites]
    try:
        sites = list(sites)
    except TypeError:
        raise ValueError(
            f"sites must be None, 'all', a site name or a list of site names; got "
            f"{type(sites).__name__}."
        ) from None
    if not sites:
        raise ValueError("sites is empty: request at least one site (or None for all).")
    valid_set = set(valid) | set(head_attention_sites(n_layers))
    bad = []
    for site in sites:
        if not isinstance(site, str):
            bad.append(f"{site!r} (not a string)")
            continue
        if site in valid_set:
            continue
        try:
            kind, layer = parse_site(site)
        except ValueError:
            bad.append(f"{site!r} (not a site name)")
            continue
        bad.append(f"{site!r} (layer {layer} out of range 0..{n_layers - 1})")
    if bad:
        raise ValueError(
            f"Unknown site(s) for a model with {n_layers} layers: {', '.join(bad)}. "
            f"Valid sites are 'resid_pre.<l>', 'mlp_in.<l>' and 'head_attn.<l>' for l in "
            f"0..{n_layers - 1}, and 'resid_final'."
        )
    seen, dups = set(), []
    for site in sites:
        if site in seen and site not in dups:
            dups.append(site)
        seen.add(site)
    if dups:
        raise ValueError(f"Duplicate site(s): {dups}.")
    return tuple(sites)


def parse_site_spec(spec, n_layers=None):
    """Read a site specification written as one string (a command-line flag).

    Parameters
    ----------
    spec : str
        ``"all"``, ``"stride:K"``, ``"head_attn"`` or a comma-separated list of site names
        (``"resid_pre.3, resid_final"``; blanks around names are ignored).
    n_layers : int or None, default=None
        With a layer count the specification is resolved and checked by
        :func:`validate_sites`; without one it is only parsed, into what
        ``TurnActivationTransformer(sites=...)`` accepts.

    Returns
    -------
    sites : None, str, list of str or tuple of str
        Without ``n_layers``: ``None`` for ``"all"``, the ``"stride:K"`` string
        (its stride checked), ``"head_attn"``, or the list of names. With ``n_layers``: the tuple
        of :func:`validate_sites`.

    Raises
    ------
    TypeError
        If ``spec`` is not a string.
    ValueError
        For a string that is empty or holds no name, a stride that is not an
        integer >= 1, and (with ``n_layers``) every unknown or duplicate site.

    Examples
    --------
    >>> parse_site_spec("resid_pre.1, resid_final")
    ['resid_pre.1', 'resid_final']
    >>> parse_site_spec("stride:2", n_layers=4)
    ('resid_pre.0', 'resid_pre.2', 'resid_final')
    """
    if not isinstance(spec, str):
        raise TypeError(f"a site specification is a string, got {type(spec).__name__}.")
    text = spec.strip()
    if text == "all":
        parsed = None
    elif text.startswith("stride:"):
        _parse_stride(text)
        parsed = text
    elif text == _HEAD_ATTN:
        parsed = text
    else:
        parsed = [name.strip() for name in text.split(",") if name.strip()]
        if not parsed:
            raise ValueError(f"site specification {spec!r} names no site; use 'all', "
                             "'stride:K' or a comma-separated list of site names.")
    if n_layers is None:
        return parsed
    return validate_sites(parsed, n_layers)


# --------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class DecoderLayout:
    """Where each site lives in a loaded decoder-only model.

    Attributes
    ----------
    decoder : torch.nn.Module
        The base decoder (e.g. ``LlamaModel``); calling it runs embeddings, layers
        and the final norm, never the LM head.
    layers : list of torch.nn.Module
        The decoder layers, in order. ``resid_pre.l`` is the input of ``layers[l]``.
    final_norm : torch.nn.Module
        ``resid_final`` is its output.
    mlp_in_norms : list of torch.nn.Module
        ``mlp_in.l`` is the output of ``mlp_in_norms[l]`` (the norm feeding the MLP).
    embedding : torch.nn.Module
        The token embedding; its output is the input of ``layers[0]``.
    family : str
        ``"pre-norm"`` (Llama, SmolLM2, Mistral, Qwen2/3, Phi-3, Gemma 1) or
        ``"sandwich-norm"`` (Gemma 2/3).
    mlp_in_attribute : str
        Attribute name of the MLP-input norm on each layer.
    """

    decoder: object
    layers: list
    final_norm: object
    mlp_in_norms: list
    embedding: object
    family: str
    mlp_in_attribute: str

    @property
    def n_layers(self):
        """Number of decoder layers."""
        return len(self.layers)

    def post_attention_norm(self, layer):
        """The MLP-input norm of ``layer`` (the module whose output is ``mlp_in.layer``)."""
        return self.mlp_in_norms[layer]


def _find_decoder(model):
    cls = type(model).__name__
    # A base decoder itself (LlamaModel, ...).
    if hasattr(model, "layers") and hasattr(model, "norm"):
        return model
    candidates = []
    inner = getattr(model, "model", None)
    if inner is not None:
        candidates.append(inner)
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            candidates.append(get_decoder())
        except Exception:  # noqa: BLE001 - best-effort lookup, reported below
            pass
    for cand in candidates:
        if cand is not None and hasattr(cand, "layers") and hasattr(cand, "norm"):
            return cand
        # Multimodal wrappers: model.model.language_model
        lm = getattr(cand, "language_model", None)
        if lm is not None and hasattr(lm, "layers") and hasattr(lm, "norm"):
            return lm
    raise ValueError(
        f"Cannot find the base decoder of {cls}: expected a module with 'layers' and "
        "'norm' attributes at model.model or model.get_decoder() (Llama-family layout). "
        "Supported families: Llama/SmolLM2, Mistral, Qwen2/Qwen3, Phi-3, Gemma/Gemma2/Gemma3."
    )


def decoder_layout(model):
    """Locate the modules holding every site of a decoder-only model.

    Supported layouts (detected from the layer's modules, not from class names):

    ``pre-norm`` — Llama, SmolLM2, Llama 3, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1.
        Each layer computes ``h = x + attn(input_layernorm(x))`` then
        ``h + mlp(post_attention_layernorm(h))``; ``mlp_in.l`` is the output of
        ``post_attention_layernorm``.
    ``sandwich-norm`` — Gemma 2, Gemma 3.
        ``post_attention_layernorm`` normalises the attention *output* before the
        residual add; the MLP reads ``pre_feedforward_layernorm(h)``, so
        ``mlp_in.l`` is the output of ``pre_feedforward_layernorm``.

    Other layouts (post-norm models such as OLMo-2 without ``input_layernorm``,
    GPT-2-style ``transformer.h``, Phi-2's ``final_layernorm``) are refused.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM (``*ForCausalLM``) or its base decoder.

    Returns
    -------
    layout : DecoderLayout

    Raises
    ------
    ValueError
        Naming the model class and the missing attribute when the layout is not
        one of the supported ones.
    """
    cls = type(model).__name__
    decoder = _find_decoder(model)
    dec_cls = type(decoder).__name__
    layers = list(decoder.layers)
    if not layers:
        raise ValueError(f"{cls}: the decoder {dec_cls} has no layers.")
    embedding = getattr(decoder, "embed_tokens", None)
    if embedding is None:
        raise ValueError(
            f"{cls}: the decoder {dec_cls} has no 'embed_tokens' attribute "
            "(unsupported layout)."
        )
    final_norm = decoder.norm
    family = None
    attr = None
    for i, layer in enumerate(layers):
        lcls = type(layer).__name__
        for needed in ("input_layernorm", "mlp", "post_attention_layernorm"):
            if not hasattr(layer, needed):
                raise ValueError(
                    f"{cls}: decoder layer {i} ({lcls}) has no '{needed}' attribute; "
                    "skafa supports pre-norm (Llama, Qwen2, Mistral, Phi-3, Gemma) and "
                    "sandwich-norm (Gemma 2/3) layouts only."
                )
        has_pre_ff = hasattr(layer, "pre_feedforward_layernorm")
        has_post_ff = hasattr(layer, "post_feedforward_layernorm")
        if has_pre_ff and has_post_ff:
            this_family, this_attr = "sandwich-norm", "pre_feedforward_layernorm"
        elif not has_pre_ff and not has_post_ff:
            this_family, this_attr = "pre-norm", "post_attention_layernorm"
        else:
            missing = "post_feedforward_layernorm" if has_pre_ff else "pre_feedforward_layernorm"
            raise ValueError(
                f"{cls}: decoder layer {i} ({lcls}) has no '{missing}' attribute but has "
                "the other feed-forward norm; unknown layout."
            )
        if family is None:
            family, attr = this_family, this_attr
        elif (family, attr) != (this_family, this_attr):
            raise ValueError(f"{cls}: decoder layers mix layouts ({family} and {this_family}).")
    mlp_in_norms = [getattr(layer, attr) for layer in layers]
    return DecoderLayout(
        decoder=decoder,
        layers=layers,
        final_norm=final_norm,
        mlp_in_norms=mlp_in_norms,
        embedding=embedding,
        family=family,
        mlp_in_attribute=attr,
    )
