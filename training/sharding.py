"""How SPMD shards each tensor over the ``data x fsdp x tp`` mesh: one rule, shared by the XLA
backend (which applies it with ``torch_xla``) and the planner (which counts bytes with it). Plain
Python: nothing here imports ``torch_xla``.

A partition spec has one entry per tensor dimension: a mesh axis name, a tuple of axis names (the
dimension is split over their product), or ``None`` (not split).
"""
from __future__ import annotations

# Column-parallel projections (output features split over tp) and row-parallel ones (input
# features split over tp), by module name (model.py's naming contract).
COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3")
ROW_PARALLEL = ("wo", "w2")
# The mesh axes the batch, and with it every activation's batch dimension, is split over.
BATCH = ("data", "fsdp")


def param_partition_spec(name: str, p) -> tuple | None:
    """The SPMD partition spec of a parameter (``None``: replicated)."""
    if p.ndim != 2:
        return None  # norms, gates, biases, scalars: tiny, replicated
    module = name.split(".")[-2] if "." in name else name
    if module in COLUMN_PARALLEL:
        return ("tp", "fsdp")
    if module in ROW_PARALLEL:
        return ("fsdp", "tp")
    return ("fsdp", None)  # embeddings, mHC projections, pooling: FSDP only


def activation_partition_spec(module: str, ndim: int, output: bool) -> tuple:
    """The SPMD partition spec of an activation ``[batch, ..., features]`` going into (``output``
    false) or out of a Linear named ``module`` (or, with any other name, of the embedding or a
    block).

    The batch is split over data x fsdp, as the input batch is; the features are split over tp
    where the Linear's tp-sharded weight puts them (out of a column-parallel projection, into a
    row-parallel one: Megatron's layout), and whole elsewhere.

    Without these constraints GSPMD's propagation follows the weights' shardings instead of the
    batch's: on a data 2 x fsdp 2 mesh it gathered the token ids, ran every activation with the
    whole global batch on each device, split by features like the weights, and all-reduced their
    partial products (``bench/optimizer.py --only activations``).
    """
    if ndim < 2:
        return (None,) * ndim   # no batch dimension: whole
    tp = (module in COLUMN_PARALLEL and output) or (module in ROW_PARALLEL and not output)
    return (BATCH,) + (None,) * (ndim - 2) + ("tp" if tp else None,)


def state_partition_spec(spec: tuple | None, over_data: bool) -> tuple | None:
    """The spec of a parameter's gradient and optimiser state.

    Like the parameter's, except with ``over_data`` (ZeRO-2 style) the ``fsdp`` dimension is split
    over ``fsdp x data``: each data-parallel replica keeps 1/data of the state instead of all of it.
    The traffic stays the same (the gradient is reduce-scattered over data x fsdp instead of
    reduce-scattered over fsdp then all-reduced over data; the updated shard is all-gathered over
    data). Replicated tensors (``None``) stay replicated: they are tiny.

    fsdp before data: the piece a device keeps is then part of its own fsdp shard of the parameter
    (piece ``f * data + d`` of device (d, f), within shard f), so the update needs no other
    device's numbers. Split data-major, piece ``d * fsdp + f`` lies in another device's shard and
    XLA moved it there and back (``bench/optimizer.py --only zero``: 76 collective-permutes in the
    update, twice its collective bytes).
    """
    if spec is None or not over_data:
        return spec
    return tuple(("fsdp", "data") if axis == "fsdp" else axis for axis in spec)


def shard_factor(spec: tuple | None, mesh: dict[str, int]) -> int:
    """Into how many pieces ``spec`` cuts a tensor on a mesh ``{"data": d, "fsdp": f, "tp": t}``."""
    if spec is None:
        return 1
    n = 1
    for axis in spec:
        for name in (axis if isinstance(axis, tuple) else (axis,)):
            if name is not None:
                n *= mesh[name]
    return n
