"""Direct launches of compiled Triton kernels: the JIT's per-call argument binding paid once per specialization.

Why. ``kernel[grid](**kwargs)`` binds and specializes every argument in Python and C, builds the cache key and
looks the compiled kernel up before it launches: 25 µs of host time per call on the H100 host of the device tool
(Triton 3.6), against 7 µs for the launch itself (``CompiledKernel.run``). An eager decode step calls two or three
kernels per layer, so PagedCache under ``model.generate`` (no CUDA graph) would be bound by that host time.

How. ``Launcher(jit_fn)`` keeps the ``CompiledKernel`` that Triton chose for a call under a key computed by a
function generated for the kernel's signature (as Triton generates its binder): for each argument the facts
Triton's specialization may depend on, and nothing cheaper:

    tensor            -> (dtype, data_ptr % 16 == 0)        Triton: pointer type + 16-byte alignment
    int, specialized  -> the value itself                    Triton: (== 1, % 16 == 0, i32/i64): a function of it
    int, do_not_specialize -> (== 1, fits in int32)          Triton: i32 or i64 (and == 1 in some versions)
    float             -> nothing                             Triton: fp32, never specialized
    constexpr         -> the value                           part of Triton's key
plus num_warps / num_stages / launch_pdl and the device. The key may split one Triton specialization into several
entries (an int's exact value), never merge two, so a key hit always launches the kernel Triton would have
launched. A miss goes through ``jit_fn[grid](...)`` (which compiles or finds the kernel) and records what it returned.

Where it is off (the standard launch is used): under ``TRITON_INTERPRET=1`` (the CPU tests), with
``HF_PAGED_DIRECT_LAUNCH=0``, and on a Triton whose ``CompiledKernel.run`` has another calling convention than the
one checked here (3.4 to 3.x). ``HF_PAGED_CHECK_LAUNCH=1`` (the GPU test run sets it) checks every direct launch
against the kernel Triton's own lookup returns, so a key that misses a specialization fails the tests.
"""

import contextlib
import os

import torch

__all__ = [
    "BoundLaunch",
    "Launcher",
    "SignatureCache",
    "active_hook",
    "cdiv",
    "direct_launch_enabled",
    "kernel_params",
    "make_key_fn",
    "next_power_of_2",
    "on_device",
]


def _version_ok() -> bool:
    import triton

    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return major == 3 and minor >= 4


def direct_launch_enabled() -> bool:
    """Whether launches skip the JIT's binding (see the module docstring); read at each Launcher's first call."""
    return (
        os.environ.get("TRITON_INTERPRET") != "1"
        and os.environ.get("HF_PAGED_DIRECT_LAUNCH", "1") != "0"
        and _version_ok()
    )


def make_key_fn(jit_fn, args: tuple):
    """The specialization key of the kernel's positional arguments, as generated code (one expression per
    argument, no call per argument): the argument kinds are those of ``args``, the launcher's first call (each
    launcher passes the same kind at each position on every call)."""
    names, items = [], []
    for param, value in zip(kernel_params(jit_fn), args, strict=True):
        name = f"a{param.num}"
        names.append(name)
        if param.is_constexpr or type(value) is bool or value is None:
            items.append(name)
        elif isinstance(value, torch.Tensor):
            items.append(f"{name}.dtype, {name}.data_ptr() & 15 == 0")
        elif type(value) is int:
            # do_not_specialize: Triton keeps only the integer type (and, in some versions, == 1).
            items.append(f"{name} == 1, -2147483648 <= {name} < 2147483648" if param.do_not_specialize else name)
        elif type(value) is not float:  # floats are fp32 arguments, never specialized
            raise TypeError(f"hf_paged kernels: unsupported kernel argument {param.name}={value!r}")
    src = f"def key({', '.join(names)}):\n    return ({', '.join(items)},)\n"
    scope: dict = {}
    exec(src, scope)  # noqa: S102 - generated from the kernel's own parameter list
    return scope["key"]


def kernel_params(jit_fn) -> list:
    """The kernel's parameters (name, constexpr, do_not_specialize); under TRITON_INTERPRET=1 the decorator returns
    an InterpretedFunction, which keeps the function and the decorator's arguments to build them from."""
    if hasattr(jit_fn, "params"):
        return jit_fn.params
    from triton.runtime.jit import JITFunction

    return JITFunction(jit_fn.fn, **jit_fn.kwargs).params


class Launcher:
    """Launch ``jit_fn`` with positional arguments, skipping Triton's per-call binding after the first call.

    Args:
        jit_fn: a ``@triton.jit`` kernel. Call as ``launcher(grid, *args, num_warps=..., num_stages=...,
            launch_pdl=...)`` with every kernel parameter positionally, constexprs included, in the kernel's order.
    """

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self._cache: dict = {}
        self._enabled: bool | None = None
        self._key_fn = None
        self._stream = None
        self._check = False
        self._hooks = None

    def _setup(self) -> None:
        from triton.runtime.jit import JITFunction

        self._enabled = direct_launch_enabled() and isinstance(self.jit_fn, JITFunction)
        if not self._enabled:
            return
        try:
            from triton import knobs
            from triton.runtime.driver import driver
        except ImportError:  # before 3.4: launch hooks lived elsewhere; use the standard launch
            self._enabled = False
            return
        self._hooks = knobs.runtime
        self._stream = driver.active.get_current_stream
        self._check = os.environ.get("HF_PAGED_CHECK_LAUNCH") == "1"

    def __call__(self, grid: tuple, *args, num_warps: int = 4, num_stages: int = 2, launch_pdl: bool = False) -> None:
        # launch_pdl (programmatic dependent launch, SM90+): the kernel may start while the previous one in the stream
        # runs, and must wait for it (griddepcontrol.wait) before reading what it wrote. Passed only when True, so the
        # other launches keep the options of Triton versions without it.
        options = {"num_warps": num_warps, "num_stages": num_stages}
        if launch_pdl:
            options["launch_pdl"] = True
        if self._enabled is None:
            self._setup()
        if not self._enabled:
            self.jit_fn[grid](*args, **options)
            return
        if self._key_fn is None:
            self._key_fn = make_key_fn(self.jit_fn, args)
        device = torch.cuda.current_device()
        key = (device, num_warps, num_stages, launch_pdl, self._key_fn(*args))
        kernel = self._cache.get(key)
        if kernel is None:
            self._cache[key] = self.jit_fn[grid](*args, **options)
            return
        if self._check:
            expected = self.jit_fn.run(*args, grid=grid, warmup=True, **options)
            if expected is not kernel:
                raise RuntimeError(
                    f"hf_paged direct launch of {self.jit_fn.__name__}: the cached kernel is not the one Triton "
                    "selects for these arguments (the launch key misses a specialization); set "
                    "HF_PAGED_DIRECT_LAUNCH=0 and report this"
                )
        stream = self._stream(device)
        enter, leave = active_hook(self._hooks.launch_enter_hook), active_hook(self._hooks.launch_exit_hook)
        grid0 = grid[0]
        grid1 = grid[1] if len(grid) > 1 else 1
        grid2 = grid[2] if len(grid) > 2 else 1
        metadata = kernel.launch_metadata(grid, stream, *args) if enter is not None else None
        kernel.run(grid0, grid1, grid2, stream, kernel.function, kernel.packed_metadata, metadata, enter, leave, *args)

    def bind(self, grid: tuple, args: tuple, positions: tuple[int, ...], *, num_warps: int = 4, num_stages: int = 2):
        """A ``BoundLaunch`` of the kernel this launcher launched last for ``args`` on the current device: ``grid``
        and ``args`` kept, the arguments at ``positions`` given anew at each launch. None where direct launches are
        off or no launch with these arguments' key has happened yet. (A launch hook installed later, e.g. by a
        profiler, sends the bound launches through this launcher again, which calls it.)

        The caller's contract (checked by the caller, cheaply, before each ``BoundLaunch.launch``): the new
        arguments have the facts the key records (``make_key_fn``: a tensor's dtype and 16-byte alignment), and
        the kept arguments still describe them (strides, sizes)."""
        if self._enabled is None:
            self._setup()
        if not self._enabled or self._key_fn is None:
            return None
        device = torch.cuda.current_device()
        kernel = self._cache.get((device, num_warps, num_stages, False, self._key_fn(*args)))
        if kernel is None:
            return None
        return BoundLaunch(self, kernel, grid, args, positions, num_warps, num_stages, self._stream(device))


class BoundLaunch:
    """One kernel launch kept whole (``Launcher.bind``): ``launch(*values)`` relaunches it with ``values`` at the
    bound positions, on the stream of the bind, without computing a launch key (a few µs a call less than a
    ``Launcher`` call, with its argument list built once). For a launch repeated with other tensors of the same
    layout, e.g. one attention layer after another in an eager decode step."""

    def __init__(self, launcher, kernel, grid, args, positions, num_warps, num_stages, stream):
        self._launcher = launcher
        self._kernel = kernel
        self._function, self._metadata = kernel.function, kernel.packed_metadata
        self._grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self._args = list(args)
        self._positions = positions
        self._options = {"num_warps": num_warps, "num_stages": num_stages}
        self._stream = stream

    def launch(self, *values) -> None:
        args = self._args
        for position, value in zip(self._positions, values, strict=True):
            args[position] = value
        if self._launcher._check:
            expected = self._launcher.jit_fn.run(*args, grid=self._grid, warmup=True, **self._options)
            if expected is not self._kernel:
                raise RuntimeError(
                    f"hf_paged bound launch of {self._launcher.jit_fn.__name__}: the kept kernel is not the one "
                    "Triton selects for these arguments (a new argument breaks the bind's contract); set "
                    "HF_PAGED_DIRECT_LAUNCH=0 and report this"
                )
        hooks = self._launcher._hooks
        if active_hook(hooks.launch_enter_hook) is not None or active_hook(hooks.launch_exit_hook) is not None:
            self._launcher(self._grid, *args, **self._options)  # a profiler's hooks: the launcher calls them
            return
        g0, g1, g2 = self._grid
        self._kernel.run(g0, g1, g2, self._stream, self._function, self._metadata, None, None, None, *args)


def active_hook(hook):
    """A Triton launch hook, or None when there is none to call. From Triton 3.5 the knobs hold a ``HookChain`` that
    is never None, even with no hook in it: passing it makes every launch build ``kernel.launch_metadata`` (a
    dict and a LazyDict) for nobody."""
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook


class SignatureCache:
    """What a launcher computes once per argument signature (shapes, strides, dtypes, devices of checked arguments)
    and reuses on every later call with it: eager decoding calls each launcher once per layer per step with one
    signature, so the checks and launch settings are paid once. Holds at most ``max_size`` entries and starts over
    when full (rare: e.g. prefills of many lengths), so its memory stays bounded."""

    def __init__(self, max_size: int = 256):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self._entries: dict = {}
        self.get = self._entries.get  # the hot path: one dict lookup, no Python frame

    def put(self, signature: tuple, value) -> None:
        if len(self._entries) >= self.max_size:
            self._entries.clear()
        self._entries[signature] = value

    def clear(self) -> None:
        self._entries.clear()

    def values(self) -> list:
        return list(self._entries.values())

    def __iter__(self):
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


# Host-side integer helpers: triton.cdiv / triton.next_power_of_2 are ConstexprFunctions in Triton 3.x, 7 µs a call
# from Python.
def cdiv(a: int, b: int) -> int:
    """Ceil of a / b for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_SAME_DEVICE = contextlib.nullcontext()


def on_device(tensor: torch.Tensor):
    """Make the tensor's GPU current for a launch (Triton launches on the current device; several GPUs under
    device_map). A no-op context when it already is, or for a CPU tensor: ``torch.cuda.device`` costs a few µs."""
    index = tensor.get_device()
    if index < 0 or index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(index)
