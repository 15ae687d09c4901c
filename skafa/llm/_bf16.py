"""bfloat16 linear layers on CPUs without bfloat16 matrix units.

PyTorch's CPU kernel for a bfloat16 matrix product is fast where the CPU has
bfloat16 units (AVX512-BF16, AMX-BF16) and several times slower than float32
where it has not (an AVX2-only CPU: a bfloat16 forward pass of
Qwen2.5-Coder-0.5B took 5.6x float32's time, ``examples/benchmark_dtype.py``).
Both kernels multiply the bfloat16 inputs exactly, accumulate in float32 and
round the result to bfloat16 once. :func:`bf16_matmul_via_float32` makes a
model's ``nn.Linear`` layers do the same through float32's kernel: the input and
the weight are upcast (exactly), multiplied with float32 accumulation, and the
result rounded to bfloat16, at about float32's speed (0.95x its time on that
CPU), with the weights kept in bfloat16 (half float32's memory).

It is another summation order of the same bfloat16 computation, not the native
kernel's bits: one product's outputs are bit-identical to the native kernel's
for 99.99 % of them and one bfloat16 unit apart for the rest, and over a whole
model those one-unit differences grow as bfloat16 rounding does (Qwen2.5-Coder-
0.5B, 2,048 tokens: hidden states 0.7-1.4 % apart from the native kernel's,
median per site, where either is 1.1-1.4 % from float32's). A thread count or
another CPU's kernel changes bfloat16 results in the same way.

Products of fewer than ``min_rows`` input rows (a decoding step, a judge's
answer tokens), where upcasting the weight costs more than the native product,
keep the native kernel.

:func:`skafa.llm.load_model` applies it to the models it loads in bfloat16 on a
CPU without bfloat16 units (:func:`skafa.llm.cpu_has_bf16`; ``SKAFA_CPU_BF16=1``
keeps the native kernel); a model registered with
:func:`skafa.llm.register_model` is used as it is (call the function on it).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import numbers
import threading

__all__ = ["bf16_matmul_via_float32", "uses_bf16_matmul_via_float32"]

#: Input rows from which a bfloat16 product goes through float32's kernel: the two
#: cost the same at 16-32 rows of Qwen2.5-Coder-0.5B's MLP on an AVX2 CPU (one
#: thread), below that the native kernel is faster (it needs no weight upcast).
MIN_ROWS = 32


_LINEAR = None
_LINEAR_LOCK = threading.Lock()


def _kernel_linear():
    """The ``nn.Linear`` subclass the layers get (built on first use: torch is lazy).

    Module-level as ``Float32KernelLinear`` (see ``__getattr__``), so a model holding
    such layers pickles and unpickles in another process.
    """
    global _LINEAR
    with _LINEAR_LOCK:
        if _LINEAR is not None:
            return _LINEAR
        import torch
        import torch.nn.functional as F

        class Float32KernelLinear(torch.nn.Linear):
            """``nn.Linear`` whose bfloat16 products of many rows run on float32's kernel.

            Never constructed: :func:`bf16_matmul_via_float32` gives existing layers
            this class, so parameters, buffers, hooks and the state dict stay as they
            are.
            """

            _skafa_min_rows = MIN_ROWS

            def forward(self, x):
                w = self.weight
                if (x.dtype is torch.bfloat16 and w.dtype is torch.bfloat16
                        and x.device.type == "cpu"
                        and x.numel() >= self._skafa_min_rows * w.shape[1]):
                    b = None if self.bias is None else self.bias.float()
                    return F.linear(x.float(), w.float(), b).to(torch.bfloat16)
                return super().forward(x)

        Float32KernelLinear.__module__ = __name__
        Float32KernelLinear.__qualname__ = "Float32KernelLinear"
        _LINEAR = Float32KernelLinear
        return _LINEAR


def __getattr__(name):  # the class, for pickle, without importing torch before it is used
    if name == "Float32KernelLinear":
        return _kernel_linear()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def bf16_matmul_via_float32(model, *, min_rows=MIN_ROWS):
    """Make ``model``'s bfloat16 linear layers multiply through float32's CPU kernel.

    For CPUs without bfloat16 matrix units, where PyTorch's bfloat16 product is
    several times slower than float32's. Each product is the native kernel's up
    to the order of float32 sums; over a whole model the hidden states then
    differ from the native kernel's about as much as bfloat16's differ from
    float32's (another rounding of the same bfloat16 computation, as a thread
    count or another CPU's kernel gives). Every ``torch.nn.Linear`` of ``model``
    (exactly that class, not a subclass) is changed in place; weights, hooks and
    the state dict are untouched. Calling it again only updates ``min_rows``.

    Parameters
    ----------
    model : torch.nn.Module
        The model (e.g. a transformers causal LM).
    min_rows : int >= 1, default=32
        Products with fewer input rows keep the native kernel.

    Returns
    -------
    n_layers : int
        How many linear layers now take the float32 path.

    Examples
    --------
    >>> import torch
    >>> from skafa.llm import bf16_matmul_via_float32
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 4)).to(torch.bfloat16)
    >>> bf16_matmul_via_float32(net)
    1
    >>> net(torch.ones(64, 8, dtype=torch.bfloat16)).dtype
    torch.bfloat16
    """
    if (not isinstance(min_rows, numbers.Integral) or isinstance(min_rows, bool)
            or min_rows < 1):
        raise ValueError(f"min_rows must be an int >= 1, got {min_rows!r}.")
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"bf16_matmul_via_float32 takes a torch.nn.Module, got "
                        f"{type(model).__name__}.")
    linear, n = _kernel_linear(), 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = linear
        if isinstance(module, linear):
            module._skafa_min_rows = int(min_rows)
            n += 1
    return n


def uses_bf16_matmul_via_float32(model) -> bool:
    """Whether any linear layer of ``model`` takes :func:`bf16_matmul_via_float32`'s path.

    Parameters
    ----------
    model : object
        A ``torch.nn.Module``; anything without ``modules()`` gives ``False``.

    Returns
    -------
    uses : bool
    """
    if _LINEAR is None:
        return False
    modules = getattr(model, "modules", None)
    return callable(modules) and any(isinstance(m, _LINEAR) for m in modules())
