"""What every MoE backend implements, and how ``backend="auto"`` chooses one.

A backend computes the expert part of the MoE layer (dispatch, GEMM1, activation, GEMM2,
combine) for routing that is already decided. Backends are tried in ``PRIORITY`` order; the
first that is available on the default device and supports the problem wins. ``xla`` (pure
JAX) supports everything and is the reference the others are tested against.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Protocol

import jax

MODES = ("bf16", "w4a16", "w4a4")
ACTIVATIONS = ("swiglu", "geglu", "relu2", "swiglu_oai")
GATED_ACTIVATIONS = ("swiglu", "geglu", "swiglu_oai")


def default_device():
    """The device that runs uncommitted work: ``jax.default_device``'s when it is set (a device or a
    platform name), else ``jax.devices()[0]``; None where jax has no backend. Backends judge what
    they can run by it, so ``with jax.default_device(cpu)`` on a GPU machine gets the CPU's rules."""
    try:
        dev = jax.config.jax_default_device
        if isinstance(dev, str):
            return jax.devices(dev)[0]
        return dev if dev is not None else jax.devices()[0]
    except RuntimeError:
        return None


def platform(dev) -> str:
    """'cpu', 'cuda', 'rocm', another platform name (e.g. 'tpu'), or 'none' for no device."""
    if dev is None:
        return "none"
    if dev.platform == "gpu":  # jax names both CUDA and ROCm devices 'gpu'
        version = str(getattr(dev.client, "platform_version", "")).lower()
        return "rocm" if ("rocm" in version or "hip" in version) else "cuda"
    return dev.platform


def default_platform() -> str:
    """:func:`platform` of :func:`default_device`."""
    return platform(default_device())


@dataclasses.dataclass(frozen=True)
class MoEProblem:
    """Static description of one MoE call (all trace-time facts a backend may check).

    ``tokens`` is T, ``num_experts`` the local experts E held by ``experts``, ``top_k`` k;
    ``global_experts`` is the number of experts routed over (``router_logits.shape[1]``) when
    known, else None (precomputed routing); ``traced_offset``: ``local_expert_offset`` is a traced
    int32 scalar (e.g. ``lax.axis_index`` under ``shard_map``), not a Python int; ``expert_bias``: the
    experts carry a GEMM1 or GEMM2 bias (``gate_up_bias`` / ``down_bias``); ``up_global_scale``: GEMM1's up
    rows have their own global scales (:attr:`~jax_nvfp4.NVFP4Experts.up_global_scale`); ``static_input_scales``:
    mode w4a4 quantizes the activations on the experts' static scales (:attr:`~jax_nvfp4.NVFP4Experts.input_scales`).
    """

    tokens: int
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    mode: str
    activation: str
    global_experts: int | None = None
    traced_offset: bool = False
    expert_bias: bool = False
    up_global_scale: bool = False
    static_input_scales: bool = False


class Backend(Protocol):
    """A MoE expert backend.

    ``__call__(x, experts, topk_ids, topk_weights, *, problem, local_expert_offset)``:

    - ``x`` bf16 ``[T, H]``; ``experts`` :class:`~jax_nvfp4.NVFP4Experts` (w4a16/w4a4) or
      :class:`~jax_nvfp4.BF16Experts` (bf16), GEMM1 rows ``[gate; up]``;
    - ``topk_ids`` int32 ``[T, k]`` global expert ids (negative = padding; ids outside
      ``[local_expert_offset, local_expert_offset + E)`` contribute nothing);
    - ``topk_weights`` float32 ``[T, k]``;
    - ``local_expert_offset`` a Python int, or an int32 scalar array where ``problem.traced_offset``
      (a backend that cannot run a traced one there says so in ``unsupported_reason``);
    - returns bf16 ``[T, H]``.

    Optional: ``weight_order(hidden, intermediate)``, the :class:`~jax_nvfp4.NVFP4Array` byte
    order it reads fastest (``"rows"`` when absent; :func:`jax_nvfp4.weight_order`), and
    ``moe_from_logits(x, experts, router_logits, *, routing, top_k, bias, n_group,
    topk_group, routed_scaling_factor, problem, local_expert_offset)`` routes inside the backend
    and returns ``(out, topk_ids, topk_weights)``, or None when it does not apply (then
    :func:`jax_nvfp4.moe` routes in JAX and calls ``__call__``).
    """

    name: str

    def unavailable_reason(self) -> str | None:
        """None if this backend can run on the default JAX device, else why not."""

    def unsupported_reason(self, problem: MoEProblem) -> str | None:
        """None if this backend supports ``problem``, else why not."""

    def __call__(self, x, experts, topk_ids, topk_weights, *, problem: MoEProblem,
                 local_expert_offset):
        ...


class InstallProblem(str):
    """An ``unavailable_reason`` that the installation can fix (the extension not built, built without CUDA or for
    other GPUs, an optional package missing). ``backend="auto"`` then runs the layer on a slower backend without
    an error, so it warns, once per reason and process, where it passes over one that would have run the problem."""


_WARNED: set[str] = set()


def _warn_passed_over(name: str, why: str) -> None:
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"jax_nvfp4.moe(backend='auto') passes over backend {name!r}: {why}", RuntimeWarning,
                      stacklevel=4)


class Options:
    """Value semantics for a backend class whose constructor keywords are its options, each kept as an attribute
    of the same name (``options()``): equal options make equal, equally hashed instances (so ``jax.jit`` with
    the backend as a static argument, or an ``nnx`` module holding one, compiles once for them), and the repr
    shows the options that differ from the defaults, e.g. ``FFIBackend(k_split=1)``. The options are those of
    the class that subclasses ``Options`` (a subclass of it with its own ``__init__`` keeps them); treat them as
    read-only, since changing one changes the hash."""

    _option_defaults: dict = {}

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if Options in cls.__bases__:
            params = inspect.signature(cls.__init__).parameters.values()
            cls._option_defaults = {p.name: p.default for p in params if p.name != "self"
                                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

    def options(self) -> dict:
        return {k: getattr(self, k) for k in self._option_defaults if hasattr(self, k)}

    def __repr__(self):
        shown = (f"{k}={v!r}" for k, v in self.options().items() if v != self._option_defaults[k])
        return f"{type(self).__name__}({', '.join(shown)})"

    def __eq__(self, other):
        return type(self) is type(other) and self.options() == other.options()

    def __hash__(self):
        items = tuple(self.options().items())
        try:
            return hash((type(self), items))
        except TypeError:  # (an unhashable option value, e.g. a list: equal values have equal reprs)
            return hash((type(self), repr(items)))


_REGISTRY: dict[str, Backend] = {}
PRIORITY = ("flashinfer", "ffi", "xla")  # fastest first; "xla" runs everywhere


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def get(name: str) -> Backend:
    return _REGISTRY[name]


def names() -> tuple[str, ...]:
    return tuple(n for n in PRIORITY if n in _REGISTRY)


def check(backend) -> str:
    """The name of ``backend``: ``"auto"``, a registered name, or a backend instance's (e.g.
    ``FFIBackend(k_split=1)``, ``FlashInferBackend(deterministic=True)``: its options for the calls it is
    passed to, where a name takes the registered instance); anything else is an error naming the argument."""
    if isinstance(backend, str):
        valid = ("auto",) + names()
        if backend not in valid:
            raise ValueError(f"backend must be one of {valid} or a backend instance, got {backend!r}")
        return backend
    if isinstance(backend, type) or not (callable(backend) and isinstance(getattr(backend, "name", None), str)
            and all(callable(getattr(backend, a, None)) for a in ("unavailable_reason", "unsupported_reason"))):
        got = f"the class {backend.__name__}" if isinstance(backend, type) else type(backend).__name__
        raise TypeError(f"backend must be a name or a backend instance (name, unavailable_reason, "
                        f"unsupported_reason, __call__: jax_nvfp4.backends.base.Backend), got {got}")
    return backend.name


def instance(backend) -> Backend:
    """The backend that ``backend`` (a registered name or an instance, not ``"auto"``) names."""
    return _REGISTRY[check(backend)] if isinstance(backend, str) else backend


def select(backend, problem: MoEProblem) -> Backend:
    """Resolve ``backend`` (``"auto"``, a registered name or a backend instance) for ``problem``.

    An explicit backend that cannot run or does not support the problem is a ValueError
    saying why; ``"auto"`` falls back along ``PRIORITY`` (with a warning where it passes over a backend for an
    :class:`InstallProblem`).
    """
    name = check(backend)
    if name != "auto":
        b = instance(backend)
        why = b.unavailable_reason() or b.unsupported_reason(problem)
        if why:
            raise ValueError(f"backend={name!r} cannot run this MoE: {why}")
        return b
    for n in names():
        b = _REGISTRY[n]
        why = b.unavailable_reason()
        if why is None and b.unsupported_reason(problem) is None:
            return b
        if isinstance(why, InstallProblem) and b.unsupported_reason(problem) is None:
            _warn_passed_over(n, why)
    raise ValueError(f"no MoE backend supports {problem}")
