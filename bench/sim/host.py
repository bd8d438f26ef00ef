"""A host process of simulated workers: ``python -m bench.sim.host SPEC.json``.

Runs many simulated devices as threads of one process (each thread with its own store client:
ZeroMQ sockets are not thread-safe) against a real store node over TCP. The controller
(``bench.sim.cluster``) talks to it over two sockets:

    controller PUB  --{"version", "admitted", "stop"}-->  SUB here   (state, re-sent every 50 ms)
    controller PULL <--{"kind": "ready" | "version" | "done", ...}--  PUSH here

Two shapes, chosen by ``spec["mode"]``:
- ``sync`` (colocated): ``devices`` threads that do every stage in turn, fed by one claimer
  (``bench.sim.colocated.ColocatedTurns``), plus a ``TrainerGroup`` over the same device names;
  an orchestrator runs one stage at a time: iteration k's rollout (when the controller admitted
  k), then reward, then reference, then training until version k+1 is announced. No two stages
  overlap.
- streaming (``periodic``/``async``): pools of stage threads that long-poll the store and a
  ``TrainerGroup`` if this host has trainer devices; they run until the controller says stop.

Invariant: a clean stop flushes every pending write+ack (no row is left leased).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

import msgpack
import zmq

import storage
from bench.sim.colocated import ColocatedTurns
from bench.sim.engine import (
    DeviceClock,
    SimReferenceStage,
    SimRewardStage,
    SimRolloutStage,
    TrainerGroup,
    VersionBoard,
)
from workers.engines.sim_cost import Workload, group_lengths, preset
from workers.roles.loop import StageLoop


class _NoEvents:
    def send(self, record: Any) -> None:  # spans come from the device clock instead
        pass


class Host:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.cost = preset(spec["cost"])
        self.w = Workload(**spec["workload"])
        self.clock = DeviceClock(spec["time_scale"])
        self.board = VersionBoard()
        # Every response length of the run, drawn once at start-up and shared by the threads.
        self.lengths = {
            g: group_lengths(self.w, g)
            for g in range(self.w.iterations * self.w.prompts_per_iteration)
        }
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 2000)
        self.push.connect(spec["report_address"])
        self._push_lock = threading.Lock()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(spec["state_address"])
        self.threads: list[threading.Thread] = []
        self._warm_cv = threading.Condition()
        self._warm = 0  # threads whose store connection is up
        self.heard = threading.Event()  # the first state message arrived (PUB/SUB joins late)
        self.turns = 0

    def report(self, msg: dict[str, Any]) -> None:
        with self._push_lock:
            self.push.send(msgpack.packb(msg))

    def client(self) -> Any:
        return storage.connect(self.spec["store_addresses"], request_timeout=30.0)

    def warm_client(self) -> Any:
        """A client whose connection is up (one round trip now, not in the first timed claim),
        counted towards this host's readiness."""
        client = self.client()
        client.tables()
        with self._warm_cv:
            self._warm += 1
            self._warm_cv.notify_all()
        return client

    def _listen(self) -> None:
        while not self.board.stopped:
            if self.sub.poll(100):
                state = msgpack.unpackb(self.sub.recv())
                self.board.update(state["version"], state["admitted"], state["stop"])
                self.heard.set()

    def _stage(self, role: str, device: str) -> Any:
        if role == "rollout":
            stage = SimRolloutStage(device, self.cost, self.w, self.clock, self.board)
            stage.lengths = self.lengths
            return stage
        if role == "reward":
            return SimRewardStage(device, self.cost, self.w, self.clock)
        if role == "reference":
            slow = self.spec.get("slowdown", {}).get(device, 1.0)
            return SimReferenceStage(device, self.cost, self.w, self.clock, slowdown=slow)
        raise ValueError(f"unknown simulated role {role!r}")

    def _announce(self, version: int) -> None:
        self.report({"kind": "version", "version": version, "time": time.time()})

    # -- streaming -------------------------------------------------------------------------------
    def _pool_thread(self, role: str, device: str) -> None:
        client = self.warm_client()
        session = None
        if self.spec.get("coordinator_address") and role in self.spec.get("balanced_roles", ()):
            from storage.coordinator_session import ConsumerSession

            session = ConsumerSession(
                self.spec["coordinator_address"],
                self.spec["table"],
                role,
                device,
                steal=self.spec.get("steal", True),
            )
        loop = StageLoop(
            client,
            self.spec["table"],
            self._stage(role, device),
            worker=device,
            role=role,
            events=_NoEvents(),
            session=session,
        )  # type: ignore[arg-type]
        try:
            while not self.stop.is_set():
                loop.turn(self.spec.get("claim_timeout_s", 0.5))
                self.turns += 1
            loop.flush()
        finally:
            if session is not None:
                session.close()
            client.close()

    def _trainer_thread(self, gate: threading.Event | None) -> None:
        client = self.warm_client()
        try:
            group = TrainerGroup(
                client,
                self.spec["table"],
                self.cost,
                self.w,
                self.clock,
                self.spec["trainer_devices"],
                self._announce,
                gate=gate,
                whole_iteration=self.spec.get("turns", False),
            )
            self.trainer = group
            group.run(self.stop)
        finally:
            client.close()

    # -- sync (colocated) ------------------------------------------------------------------------
    def _orchestrate(self, devices: list[str], gate: threading.Event) -> None:
        """Iteration k: rollout (once the controller admitted k), reward, reference, each a turn of
        ``ColocatedTurns`` over every device; then training's turn until version k+1 is out."""
        client = self.warm_client()
        stages = {
            role: {d: self._stage(role, d) for d in devices}
            for role in ("rollout", "reward", "reference")
        }
        turns = ColocatedTurns(client, self.spec["table"], stages, devices)
        try:
            for k in range(self.w.iterations):
                if not self.board.wait(lambda b, k=k: b.admitted > k, 600):
                    raise TimeoutError(f"iteration {k} was never admitted")
                if self.board.stopped:
                    break
                for role in stages:
                    turns.turn(role, self.w.rows_per_iteration)
                gate.set()  # training's turn, until the step announces version k+1
                self.board.wait(lambda b, k=k: b.version > k, 600)
                gate.clear()
            self.board.wait(lambda b: False, 600)  # until the controller says stop
        finally:
            self.turns += turns.micro_batches
            turns.close()
            client.close()
            self.stop.set()

    # -- lifecycle -------------------------------------------------------------------------------
    def _start(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def run(self) -> int:
        listener = threading.Thread(target=self._listen, daemon=True)
        listener.start()
        if not self.heard.wait(30):
            raise TimeoutError("no state from the controller in 30 s")
        sync = self.spec["mode"] == "sync"
        gate = threading.Event() if sync else None
        if self.spec.get("trainer_devices"):
            self._start(self._trainer_thread, gate)
        if sync:
            self._start(self._orchestrate, self.spec["devices"], gate)
        else:
            for role, devices in self.spec["pools"].items():
                for d in devices:
                    self._start(self._pool_thread, role, d)
        # one store client per streaming stage thread; one for a colocated host's turns
        expected = 1 if sync else sum(len(d) for d in self.spec["pools"].values())
        expected += 1 if self.spec.get("trainer_devices") else 0
        with self._warm_cv:
            if not self._warm_cv.wait_for(lambda: self._warm >= expected, 60):
                raise TimeoutError("simulated workers could not reach the store in 60 s")
        cpu0 = time.process_time()
        self.report({"kind": "ready", "host": self.spec["host"]})
        self.board.wait(lambda b: False, 3600)  # until stop
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)
        trainer = getattr(self, "trainer", None)
        self.report(
            {
                "kind": "done",
                "host": self.spec["host"],
                "cpu_s": time.process_time() - cpu0,
                "turns": self.turns,
                "trainer_micro_batches": trainer.micro_batches if trainer else 0,
                "holds": [list(asdict(h).values()) for h in self.clock.holds],
            }
        )
        listener.join(timeout=2)
        self.push.close()
        self.sub.close()
        self.ctx.term()
        return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.sim.host SPEC.json", file=sys.stderr)
        return 2
    with open(args[0]) as fh:
        spec = json.load(fh)
    return Host(spec).run()


if __name__ == "__main__":
    sys.exit(main())
