"""Data-parallel serving: one serving engine per replica along the mesh's ``data`` axis.

On a mesh with ``data`` = R > 1, a :class:`~dayzero.engine.serving.ServingEngine` is R replicas,
each a serving engine of its own on its slice of the devices (``tensor`` x ``expert`` devices,
the weights laid out there as the rules say): its own slots (``ServingConfig.slots`` each), its
own page pool on its own devices, its own prefix cache and scheduler. A request goes to the
replica with the fewest requests waiting or running (the first of those on a tie), and stays
there; its tokens are those one device would give (a request's tokens depend only on its own
inputs, see ``serving``). Memory scales with R: each replica's pool holds its own requests only.

Every step steps each replica in turn. JAX dispatches asynchronously, but each replica's step
reads its sampled tokens back before the next replica's step is dispatched, so the replicas'
device work does not yet overlap (the next step for throughput: dispatch every replica's
forward, then read all tokens back).

Across processes a replica's devices may all belong to another process, which could not read
its tokens back: there (not every mesh device addressable from this process), the serving
engine stays one engine over the whole mesh, its pool replicated over ``data``
(:func:`serves_replicas` decides; ``ServingEngine.replicas`` reports which).
"""

from __future__ import annotations

import dataclasses
import itertools
import jax

from dayzero.engine.generate import Completion, Engine
from dayzero.engine.paged_steps import ServingConfig
from dayzero.engine.runtime import on_placement
from dayzero.engine.serving import ConstraintError, Event, ServingEngine, ServingStats
from dayzero.sharding import rules as R
from dayzero.sharding.placement import Placement, rules_for_mesh


def serves_replicas(placement: Placement | None) -> bool:
    """Whether serving on ``placement`` runs one replica per ``data`` index (see the module
    docstring): a ``data`` axis > 1 and every device of the mesh in this process."""
    if placement is None or placement.axes["data"] == 1:
        return False
    return all(d.process_index == jax.process_index() for d in placement.mesh.devices.flat)


def replica_placements(placement: Placement) -> list[Placement]:
    """One placement per index of ``placement``'s ``data`` axis: its ``tensor`` x ``expert``
    devices, with the rules those axes choose (one device: everything whole on it)."""
    axes = {a: s for a, s in placement.axes.items() if a != "data"}
    rules = rules_for_mesh(axes)
    data_index = list(placement.mesh.axis_names).index("data")
    grid = placement.mesh.devices
    slices = [R.grid_devices(grid.take([i], axis=data_index)) for i in range(placement.axes["data"])]
    return [Placement(R.make_mesh(axes, devices), rules) for devices in slices]


class ReplicatedServing(ServingEngine):
    """A :class:`ServingEngine` made of data-parallel replicas (see the module docstring); made by
    ``ServingEngine(engine, config)`` when :func:`serves_replicas`, with the same interface."""

    def __init__(self, engine: Engine, config: ServingConfig = ServingConfig()):
        self.engine = engine
        self.replicas = [ServingEngine(Engine(engine.config, engine.weights, engine.tokenizer,
                                              run=on_placement(engine.run, engine.config, placement)), config)
                         for placement in replica_placements(engine.placement)]
        for replica in self.replicas:  # images are preprocessed as the engine was told to
            replica.engine.image_config = engine.image_config
        self.config = self.replicas[0].config
        self.steps = self.replicas[0].steps  # one replica's steps (every replica runs the same shapes)
        self._ids = itertools.count()
        self._where: dict[int, tuple[int, int]] = {}  # request id -> (replica, its id there)
        self._ours: list[dict[int, int]] = [{} for _ in self.replicas]  # per replica: its id -> request id
        self._cancelled: set[int] = set()
        self._held: list[Event] = []  # events of a step cut short by a ConstraintError, for the next

    @property
    def stats(self) -> ServingStats:
        """The replicas' counters added up (``peak_pages``: the sum of each pool's peak, an upper
        bound of the pages in use at once; ``largest_chunk_scores``: the largest replica's)."""
        fields = [f.name for f in dataclasses.fields(ServingStats)]
        each = [r.stats for r in self.replicas]
        return ServingStats(**{f: (max if f == "largest_chunk_scores" else sum)(getattr(s, f) for s in each)
                               for f in fields})

    def _request(self, *args):
        """A request validated as every replica would (they share model, tokenizer and limits)."""
        return self.replicas[0]._request(*args)

    def _enqueue(self, request) -> int:
        """Queue ``request`` on the least loaded replica, under a fresh id of that replica; returns
        this engine's id for it."""
        index = self._least_loaded()
        replica = self.replicas[index]
        request.id = next(replica._ids)
        return self._register(index, replica._enqueue(request))

    @property
    def has_work(self) -> bool:
        """Whether any replica has a request waiting or running."""
        return bool(self._held) or any(r.has_work for r in self.replicas)

    def step(self) -> list[Event]:
        """One step of every replica; their tokens, under this engine's request ids."""
        events, self._held = self._held, []
        for index, replica in enumerate(self.replicas):
            ours = self._ours[index]
            try:
                events += [dataclasses.replace(e, request_id=ours[e.request_id]) for e in replica.step()]
            except ConstraintError as e:  # raised under this engine's id; the other replicas' events wait
                self._held = events
                request_id = ours.pop(e.request_id)
                del self._where[request_id]
                raise ConstraintError(request_id, str(e).replace(f"request {e.request_id}", f"request {request_id}"))
        return events

    def _withdraw(self, request_id: int) -> bool:
        """Withdraw ``request_id`` from the replica serving it (see ``ServingEngine.cancel``)."""
        index, local = self._where.get(request_id, (None, None))
        if index is None or not self.replicas[index]._withdraw(local):
            return False
        del self._where[request_id], self._ours[index][local]
        return True

    def completion(self, request_id: int) -> Completion:
        """The finished request ``request_id``, handed over once (``KeyError`` before)."""
        index, local = self._where[request_id]
        done = self.replicas[index].completion(local)
        del self._where[request_id], self._ours[index][local]
        return done

    def _least_loaded(self) -> int:
        load = [len(r._waiting) + len(r._running()) for r in self.replicas]
        return load.index(min(load))

    def _register(self, index: int, local: int) -> int:
        request_id = next(self._ids)
        self._where[request_id] = (index, local)
        self._ours[index][local] = request_id
        return request_id
