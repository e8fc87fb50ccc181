"""8-bit weight matmuls for quantisation-aware training (QAT): the numerics behind `plan.qat`.

Both take the model's einsum `eq` (an activation x times a weight w, no batch letters) and run it
as one `jax.lax.dot_general` on 8-bit operands, accumulating wider, then rescale:

int8 (`int8_matmul`): w symmetric per output channel (max |w| over the contracted axes / 127),
    x symmetric per token (max |x| over the contracted axes / 127), both rounded to int8, the dot
    int8 x int8 -> int32 (`preferred_element_type=int32`), times s_x s_w. No state. Backward:
    straight-through: the gradients of the unquantised einsum, in the compute dtype (the saved
    residuals are the unquantised x and w, as without QAT). The weight's int8 values and
    scales (`int8_weight`) are computed outside the `custom_vjp`, where the caller lays them
    out (on the weight's shards, before fsdp's gather: `qat.layout.on_shards`).
fp8 (`fp8_matmul`): the float8 training recipe (NVIDIA Transformer Engine, torchao float8):
    per-tensor scales, x and w cast to e4m3 (max 448) for the forward dot, the output gradient
    to e5m2 (max 57344) for both backward dots (dx = g w^T, dw = x^T g, fp32 accumulation). The
    backward keeps x and w as e4m3 (1 byte per element instead of the compute dtype's). x is
    cast outside the `custom_vjp` (`quantize_input`), so the sites reading one input (q, k, v;
    gate, up) can share one cast, and the backward one saved copy; w too (`quantize_weight`),
    where the caller lays it out (on the weight's shards, so that FSDP's gathers move e4m3).
    A scale is a divisor: x8 = saturate(x / s). `scales` gives (s_x, s_w, s_g) from the amax
    history (delayed scaling); an entry <= 0 means "no history yet": that tensor is scaled by
    its own amax just in time, as is everything when `scales` is None (current scaling).
    The matmul reports the amaxes it saw as the cotangent of `scales` (the "overwrite with
    gradient" mechanism of Flax's fp8 ops): the gradient of the per-layer scales *is* the new
    amaxes (x, w from the forward, g from the backward), which `update_history` rolls in.
    The `custom_vjp`'s forward and backward are traced where the step is differentiated, after
    the manual regions of the call (a tensor-parallel group's weight shards) are gone: the
    backward takes the regions' axes from the call (`over`), so that g's amax is the whole
    tensor's, as x's and w's are (taken at the call, `quantize_input` and `quantize_weight`).

Layout of the delayed-scaling state, per layer: `SLOTS` (the inputs x of the four matmul groups:
q/k/v share theirs, gate/up theirs, as in a fused QKV or gate-up kernel; the seven weights; the
seven output gradients), each with a history of `n` amaxes; the scale of a slot is
max(history) / fp8 max. The LM head is not quantised (left to `project`'s plain einsum), as in
the published recipes (its logits feed the softmax in fp32).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxscale.axes import manual_axes

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
#: the block sites in the order of `jaxscale.hooks.projection.SITES` (the head stays high precision)
SITES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
#: which input (x) each site reads; the first site of each group records that input's amax
INPUT = {"wq": "attn_in", "wk": "attn_in", "wv": "attn_in", "wo": "attn_out",
         "w_gate": "mlp_in", "w_up": "mlp_in", "w_down": "mlp_hidden"}
RECORDS_INPUT = ("wq", "wo", "w_gate", "w_down")
SLOTS = (tuple(f"x:{g}" for g in dict.fromkeys(INPUT.values())) + tuple(f"w:{s}" for s in SITES)
         + tuple(f"g:{s}" for s in SITES))
#: the largest finite value of each role's format: x and w in e4m3, gradients in e5m2
FP8_MAX = {"x": float(jnp.finfo(E4M3).max), "w": float(jnp.finfo(E4M3).max),
           "g": float(jnp.finfo(E5M2).max)}


def slots_of(site: str) -> tuple[int, int, int]:
    """Indices into `SLOTS` of a site's (x, w, g) scales."""
    return (SLOTS.index(f"x:{INPUT[site]}"), SLOTS.index(f"w:{site}"), SLOTS.index(f"g:{site}"))


# ----------------------------------------------------------------------------- einsum -> dot
def _dims(eq: str):
    """'xs,ws->out' -> (x's contracted positions, w's, the permutation from dot_general's
    output (x's free axes, then w's) to `out`)."""
    ins, out = eq.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    shared = [c for c in xs if c in ws]
    if any(c in out for c in shared) or any(c not in out and c not in ws for c in xs + ws
                                            if c not in shared):
        raise ValueError(f"8-bit matmul of {eq!r}: only contractions of an activation with a "
                         f"weight (no batch or summed-out letters) are supported")
    free = [c for c in xs if c not in shared] + [c for c in ws if c not in shared]
    return (tuple(xs.index(c) for c in shared), tuple(ws.index(c) for c in shared),
            tuple(free.index(c) for c in out))


def _dot(eq: str, a, b, acc):
    """einsum(eq, a, b) as one dot_general accumulating in `acc`."""
    ca, cb, perm = _dims(eq)
    y = jax.lax.dot_general(a, b, ((ca, cb), ((), ())), preferred_element_type=acc)
    return y if perm == tuple(range(y.ndim)) else jnp.transpose(y, perm)


def reference(eq: str, x, w):
    """The unquantised matmul (what `jaxscale.hooks.projection.plain` computes)."""
    return jnp.einsum(eq, x, w.astype(x.dtype))


def _swap(eq: str) -> tuple[str, str]:
    """The einsums of the two backward matmuls: dx = g . w, dw = x . g."""
    ins, out = eq.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    return f"{out},{ws}->{xs}", f"{xs},{out}->{ws}"


# ----------------------------------------------------------------------------- int8
def _int8(t, axes, over: tuple = ()):
    """Symmetric int8 of t with one fp32 scale per slice over `axes` (kept as size-1 axes);
    `over`: mesh axes (manual here) that split those axes, the slice's max taken over them."""
    t32 = t.astype(jnp.float32)
    s = jnp.max(jnp.abs(t32), axis=axes, keepdims=True)
    s = (jax.lax.pmax(s, over) if over else s) / 127.0
    return jnp.clip(jnp.round(t32 / jnp.where(s == 0, 1.0, s)), -127, 127).astype(jnp.int8), s


def int8_operands(eq: str, x, w):
    """((x in int8, its per-token scales), (w in int8, its per-channel scales)), the scales kept
    as size-1 axes where the contraction was."""
    cx, cw, _ = _dims(eq)
    return _int8(x, cx), _int8(w, cw)


def int8_product(eq: str, qx, qw):
    """The int8 x int8 -> int32 dot of einsum(eq), in the output's layout."""
    return _dot(eq, qx, qw, jnp.int32)


def int8_rescale(eq: str, y, sx, sw, dtype):
    """The int32 product y (output layout) times s_x times s_w in fp32, cast to `dtype`; sx and
    sw as `int8_operands` gives them (or the slices of them matching y)."""
    cx, cw, perm = _dims(eq)
    sx, sw = jnp.squeeze(sx, cx), jnp.squeeze(sw, cw)
    fx = sx.reshape(sx.shape + (1,) * sw.ndim)
    fw = sw.reshape((1,) * sx.ndim + sw.shape)
    if perm != tuple(range(fx.ndim)):
        fx, fw = jnp.transpose(fx, perm), jnp.transpose(fw, perm)
    return (y.astype(jnp.float32) * fx * fw).astype(dtype)


def int8_weight(eq: str, w):
    """(w in int8, its per-channel fp32 scales): the weight operand, no gradient. Computed
    outside the matmul's `custom_vjp`, where the caller can lay it out (on the weight's own
    shards, so that an FSDP gather moves the int8 values: `jaxscale.strategies.qat`)."""
    _, cw, _ = _dims(eq)
    return _int8(jax.lax.stop_gradient(w), cw)


def int8_forward(eq: str, x, w, w_q=None):
    """int8 x int8 -> int32 dot of the per-token / per-channel quantised operands, rescaled,
    in x's dtype; `w_q`: the weight already quantised (`int8_weight`)."""
    cx, _, _ = _dims(eq)
    qx, sx = _int8(x, cx)
    qw, sw = int8_weight(eq, w) if w_q is None else w_q
    return int8_rescale(eq, int8_product(eq, qx, qw), sx, sw, x.dtype)


def int8_matmul(eq: str, x, w, w_q=None):
    """einsum(eq, x, w) through an int8 dot; straight-through gradients (see the module).
    `w_q`: the weight's (int8 values, scales) from `int8_weight`, computed where the caller
    placed them; None: computed here."""
    return _int8_matmul(eq, x, w, *(int8_weight(eq, w) if w_q is None else w_q))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _int8_matmul(eq: str, x, w, qw, sw):
    return int8_forward(eq, x, w, (qw, sw))


def _int8_fwd(eq, x, w, qw, sw):
    return int8_forward(eq, x, w, (qw, sw)), (x, w)


def _int8_bwd(eq, res, g):
    x, w = res
    return (*jax.vjp(lambda a, b: reference(eq, a, b), x, w)[1](g), None, None)


_int8_matmul.defvjp(_int8_fwd, _int8_bwd)


# ----------------------------------------------------------------------------- fp8
def _amax(t, over=None):
    """The per-tensor amax: over the whole tensor, also where it is traced in pieces, manual
    over mesh axes (a data region's rows, a tensor-parallel group's weight shards; `over`:
    those of the forward, for a backward traced after its region's context is gone)."""
    amax = jnp.max(jnp.abs(t.astype(jnp.float32)))
    over = manual_axes() if over is None else over
    return jax.lax.pmax(amax, over) if over else amax


def _scale(given, amax, fmax):
    """The divisor: the delayed one when there is history (> 0), else amax / fmax now."""
    now = jnp.maximum(amax, 1e-30) / fmax
    return now if given is None else jnp.where(given > 0, given, now)


def _cast(t, s, dtype):
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(t.astype(jnp.float32) / s, -fmax, fmax).astype(dtype)


def quantize_input(x, given=None):
    """(x in e4m3, its divisor, its amax), no gradient: the forward operand, computed once for
    the sites that read the same input (q, k, v; gate, up) and shared by their backward."""
    xs = jax.lax.stop_gradient(x)
    ax = _amax(xs)
    sx = _scale(None if given is None else jax.lax.stop_gradient(given), ax, FP8_MAX["x"])
    return _cast(xs, sx, E4M3), sx, ax


def quantize_weight(w, given=None):
    """(w in e4m3, its divisor, its amax), no gradient: the weight operand, computed outside the
    matmul's `custom_vjp` where the caller can lay it out (`qat.layout.on_shards`)."""
    ws = jax.lax.stop_gradient(w)
    aw = _amax(ws)
    sw = _scale(None if given is None else jax.lax.stop_gradient(given), aw, FP8_MAX["w"])
    return _cast(ws, sw, E4M3), sw, aw


def fp8_matmul(eq: str, x, w, scales=None, record_x: bool = True, x_q=None, w_q=None):
    """einsum(eq, x, w) through an e4m3 x e4m3 dot, its backward through e5m2 x e4m3 dots.
    `scales`: f32[3] divisors (x, w, g), entries <= 0 (or None) scaled just in time; the
    cotangent of `scales` is the amaxes seen (x's only if `record_x`). `x_q`, `w_q`: x already
    quantised (`quantize_input`) by a site reading the same input, w (`quantize_weight`) where
    the caller placed it."""
    scales = jnp.zeros((3,), jnp.float32) if scales is None else scales
    x8, sx, ax = quantize_input(x, scales[0]) if x_q is None else x_q
    w8, sw, aw = quantize_weight(w, scales[1]) if w_q is None else w_q
    return _fp8(eq, record_x, manual_axes(), x, x8, sx, ax, w, w8, sw, aw, scales)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8(eq, record_x, over, x, x8, sx, ax, w, w8, sw, aw, scales):
    return _fp8_fwd(eq, record_x, over, x, x8, sx, ax, w, w8, sw, aw, scales)[0]


def _fp8_fwd(eq, record_x, over, x, x8, sx, ax, w, w8, sw, aw, scales):
    y = _dot(eq, x8, w8, jnp.float32) * (sx * sw)
    # the backward keeps x and w in e4m3, as the forward read them
    return y.astype(x.dtype), (x8, w8, sx, sw, scales[2], ax if record_x else 0.0 * ax, aw,
                               jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _fp8_bwd(eq, record_x, over, res, g):
    x8, w8, sx, sw, given_g, ax, aw, x_dtype, w_dtype = res
    ag = _amax(g, over)       # the backward is traced outside the forward's manual regions
    sg = _scale(given_g, ag, FP8_MAX["g"])
    g8 = _cast(g, sg, E5M2)
    dx_eq, dw_eq = _swap(eq)
    dx = _dot(dx_eq, g8, w8, jnp.float32) * (sg * sw)
    dw = _dot(dw_eq, x8, g8, jnp.float32) * (sx * sg)
    zero = jnp.zeros((), jnp.float32)
    return (dx.astype(x_dtype.dtype), jnp.zeros_like(x8), zero, zero, dw.astype(w_dtype.dtype),
            jnp.zeros_like(w8), zero, zero, jnp.stack([ax, aw, ag]))


_fp8.defvjp(_fp8_fwd, _fp8_bwd)


# ----------------------------------------------------------------------------- delayed scaling
def init_history(n_layers: int, length: int):
    """The amax histories of every layer and slot, zero (no history: scale just in time)."""
    return {"amax_history": jnp.zeros((n_layers, len(SLOTS), length), jnp.float32)}


def _gradient_unit(unit: float):
    """[slots]: `unit` at the output gradients' slots, 1 elsewhere."""
    return jnp.asarray([unit if s[0] == "g" else 1.0 for s in SLOTS], jnp.float32)


def scales(state, unit: float = 1.0):
    """[layers, slots] divisors max(history) / fp8 max; 0 where a slot has no history yet.
    The histories hold the gradients' amaxes of the whole batch's token-mean loss; `unit`: what
    the step's output gradients are in those units (a data region differentiates its devices'
    rows' mean: the region's data degree)."""
    fmax = jnp.asarray([FP8_MAX[s[0]] for s in SLOTS], jnp.float32)
    return jnp.max(state["amax_history"], axis=-1) / fmax * _gradient_unit(unit)


def update_history(state, amax, finite, unit: float = 1.0):
    """Roll each slot's history and put the step's amax first (the gradients' in the whole
    batch's units: divided by `unit`, see `scales`), so that the histories are one device's on
    every layout and restore onto any; a skipped (non-finite) step leaves them as they were."""
    h = state["amax_history"]
    amax = amax / _gradient_unit(unit)
    new = jnp.concatenate([amax.astype(h.dtype)[..., None], h[..., :-1]], axis=-1)
    return {"amax_history": jnp.where(finite & jnp.all(jnp.isfinite(amax)), new, h)}


def probing(sum_loss_fn):
    """fn(params, batch) -> fn((params, scales), batch): the model run with `scales`
    ([layers, slots]) as the layer loop's per-layer input (`projection.layer_inputs`), so that
    differentiating with respect to `scales` gives the amaxes every matmul saw."""
    from jaxscale.hooks.projection import layer_inputs

    def run(params_scales, batch):
        params, sc = params_scales
        with layer_inputs(sc):
            return sum_loss_fn(params, batch)
    return run


def site_scales(layer_scales, site: str):
    """A site's (x, w, g) divisors from its layer's [slots] row."""
    return jnp.take(layer_scales, jnp.asarray(slots_of(site)))
