"""Flags and set-up for running an entry point on several devices (models/sharding.py has the design).

- `--mesh=data:2,model:4`: tensor parallelism over heads (`model`) and data parallelism over the batch (`data`) on
  one jax.sharding.Mesh; default none = one device, the unsharded code path.
- `--distributed`: call `jax.distributed.initialize()` first (multi-host: one process per host, all started with
  the same command). Its arguments come from `--coordinator_address` / `--num_processes` / `--process_id` when given,
  else from the environment (JAX_COORDINATOR_ADDRESS, SLURM, Open MPI, ... as jax.distributed detects them).

Entry points call `mesh = devices.setup()` at the start of main (before anything touches a device) and
`devices.place(model, mesh)` once the model and strategy exist. The flags live here rather than in common.py so
that entry points with their own model flags (eval) can import them too.
"""

from __future__ import annotations

from absl import flags

MESH = flags.DEFINE_string("mesh", None, "Device mesh, e.g. 'data:2,model:4' (model: KV heads per shard, data: the "
                           "batch); default: one device.")
DISTRIBUTED = flags.DEFINE_boolean("distributed", False, "Multi-host: call jax.distributed.initialize() before "
                                   "anything else (arguments from the flags below or the environment).")
COORDINATOR = flags.DEFINE_string("coordinator_address", None, "With --distributed: host:port of process 0.")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "With --distributed: number of processes (hosts).")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "With --distributed: this process' index.")

_initialized = False


def initialize_distributed() -> None:
    """jax.distributed.initialize() once, if --distributed (a no-op otherwise)."""
    global _initialized
    if not DISTRIBUTED.value or _initialized:
        return
    from models.sharding import initialize_distributed as init

    init(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value)
    _initialized = True


def setup(mesh: str | None = None):
    """Initialise multi-host if asked, then the --mesh (or `mesh`) as a Mesh, or None for one device."""
    from models.sharding import parse_mesh

    initialize_distributed()
    return parse_mesh(MESH.value if mesh is None else mesh)


def check_batch(batch: int, mesh) -> None:
    """Before the model loads: a --mesh whose data axis does not divide the batch is refused."""
    if mesh is not None:
        from models.sharding import check_batch as check

        check(batch, mesh)


def place(model, mesh):
    """The model on the mesh (see models.sharding.shard_model); prints where it runs. mesh None: unchanged."""
    if mesh is None:
        return model
    import jax

    from models.sharding import describe, shard_model

    model = shard_model(model, mesh)
    if jax.process_index() == 0:
        print(f"[mesh] {describe(mesh)}, {jax.process_count()} process(es)", flush=True)
    return model
