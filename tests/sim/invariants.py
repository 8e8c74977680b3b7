"""The invariants the simulation checks after every step (and once more at the end).

1. **At most one leader per epoch**: no two brokers ever act as leader of a partition at
   the same leader epoch, and the controller never names two leaders for one epoch.
2. **The high watermark is monotonic and bounded**: within one incarnation of a replica
   its HW never decreases and never exceeds its own LEO; the leader in office (the one the
   controller's current record names, at that epoch) never has a HW above the smallest
   LEO of the ISR it uses. Excluded from that minimum: an ISR member whose log shrank by a
   power loss since it last fetched from this leader (acks=all is not fsync, see the
   simulator's docstring: such a member lost data by design until it catches up again).
3. **Every acknowledged write is committed**: when the client receives an acknowledgement
   for (partition, offset, value), that record is in the committed history (some replica
   already had it below its HW); the leader in office always holds every acknowledged
   record at its offset; at the end, after healing, every acknowledged offset is below the
   leader's HW.
4. **Replicas agree below the HW**: every replica's records below its own HW equal the
   partition's committed history (the first record any replica ever held below its HW at
   that offset); committed history is never rewritten.

A violation raises ``SimulationError`` with the seed, the step and the recent trace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.controller.state import NO_LEADER
from tests.sim.simulator import Role

if TYPE_CHECKING:
    from tests.sim.simulator import Acked, BrokerProcess, Record, Replica, Simulation

TOPIC = "sim"


class InvariantChecker:
    """Incremental checks: each step costs O(brokers x partitions) plus new offsets only."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.leader_of_epoch: dict[tuple[int, int], int] = {}  # (p, epoch) -> broker
        self.controller_leader_of_epoch: dict[tuple[int, int], int] = {}
        self.hw_seen: dict[tuple[int, int, int], int] = {}  # (broker, incarnation, p)
        self.committed: dict[int, list[Record]] = {}  # p -> history below every HW
        self.verified: dict[tuple[int, int, int], int] = {}  # -> offsets checked below
        self.acked: dict[int, list[Acked]] = {}
        self.acked_verified: dict[tuple[int, int, int, int], int] = {}

    # --- every step -----------------------------------------------------------------------

    def after_step(self) -> None:
        sim = self.sim
        for (_, p), record in sim.controller.state.partitions.items():
            if record.leader == NO_LEADER:
                continue
            key = (p, record.leader_epoch)
            named = self.controller_leader_of_epoch.setdefault(key, record.leader)
            if named != record.leader:
                sim.fail(
                    f"controller named leaders b{named} and b{record.leader} for p{p} "
                    f"epoch {record.leader_epoch}"
                )
        for broker_id, proc in sim.processes.items():
            if proc is None:
                continue
            for p, rep in proc.replicas.items():
                self._check_replica(proc, broker_id, p, rep)

    def _check_replica(self, proc: BrokerProcess, broker_id: int, p: int, rep: Replica) -> None:
        sim = self.sim
        if rep.role is Role.LEADER:
            key = (p, rep.leader_epoch)
            other = self.leader_of_epoch.setdefault(key, broker_id)
            if other != broker_id:
                sim.fail(
                    f"two leaders for p{p} at epoch {rep.leader_epoch}: b{other}, b{broker_id}"
                )
        # 2. HW monotonic within an incarnation, never above the own LEO.
        hw, leo = rep.high_watermark, rep.log.leo
        if hw > leo:
            sim.fail(f"b{broker_id} p{p}: HW {hw} above its LEO {leo}")
        ident = (broker_id, proc.incarnation, p)
        previous = self.hw_seen.get(ident)
        if previous is not None and hw < previous:
            sim.fail(f"b{broker_id} p{p}: HW went back from {previous} to {hw}")
        self.hw_seen[ident] = hw
        # 4. Agreement with the committed history below the HW.
        upto = min(self.verified.get(ident, 0), rep.log.low_mark)
        history = self.committed.setdefault(p, [])
        records = rep.log.records
        for offset in range(upto, hw):
            if offset < len(history):
                if records[offset] != history[offset]:
                    sim.fail(
                        f"b{broker_id} p{p}: offset {offset} below HW {hw} holds "
                        f"{records[offset]}, but {history[offset]} was committed there"
                    )
            else:
                history.append(records[offset])
        self.verified[ident] = max(upto, hw)
        rep.log.low_mark = leo
        # Leader in office: the controller's current leader at the current epoch.
        current = sim.controller.state.partitions[(TOPIC, p)]
        state = rep.replication
        if (
            rep.role is not Role.LEADER
            or state is None
            or current.leader != broker_id
            or current.leader_epoch != rep.leader_epoch
        ):
            return
        # 2. HW never above the smallest LEO over the ISR the leader uses.
        for member in state.isr:
            if member == broker_id:
                member_leo = leo
            elif member in sim.power_damaged or sim.power_losses[member] != rep.power_seen.get(
                member
            ):
                continue
            else:
                member_leo = sim.disks[member][p].leo
            if hw > member_leo:
                sim.fail(
                    f"leader b{broker_id} p{p} epoch {rep.leader_epoch}: HW {hw} above the "
                    f"LEO {member_leo} of ISR member b{member} (ISR {list(state.isr)})"
                )
        # 3. The leader in office holds every acknowledged record.
        term = (broker_id, proc.incarnation, p, rep.leader_epoch)
        acked = self.acked.get(p, [])
        for index in range(self.acked_verified.get(term, 0), len(acked)):
            self._check_holds(broker_id, rep, acked[index])
        self.acked_verified[term] = len(acked)

    def _check_holds(self, broker_id: int, rep: Replica, ack: Acked) -> None:
        records = rep.log.records
        if ack.offset >= len(records) or records[ack.offset].value != ack.value:
            found = records[ack.offset].value if ack.offset < len(records) else "nothing"
            self.sim.fail(
                f"acknowledged write lost: p{ack.partition} offset {ack.offset} value "
                f"{ack.value}; leader b{broker_id} (epoch {rep.leader_epoch}) holds {found} there"
            )

    # --- acknowledgements and the end -------------------------------------------------------

    def on_ack(self, ack: Acked) -> None:
        history = self.committed.get(ack.partition, [])
        if ack.offset >= len(history) or history[ack.offset].value != ack.value:
            found = history[ack.offset].value if ack.offset < len(history) else "nothing yet"
            self.sim.fail(
                f"acknowledged write not committed: p{ack.partition} offset {ack.offset} "
                f"value {ack.value}; committed history has {found}"
            )
        self.acked.setdefault(ack.partition, []).append(ack)

    def at_end(self) -> None:
        """After healing and quiescing: a leader in office per partition whose HW covers
        every acknowledged offset (it also holds them: checked every step)."""
        sim = self.sim
        self.after_step()
        for p in range(sim.config.partitions):
            record = sim.controller.state.partitions[(TOPIC, p)]
            proc = sim.processes.get(record.leader) if record.leader != NO_LEADER else None
            if proc is None:
                sim.fail(f"p{p} has no live leader after healing (record {record})")
                return
            rep = proc.replicas[p]
            if rep.role is not Role.LEADER or rep.leader_epoch != record.leader_epoch:
                sim.fail(f"p{p}: b{record.leader} has not taken office after healing ({record})")
            for ack in self.acked.get(p, []):
                self._check_holds(record.leader, rep, ack)
                if ack.offset >= rep.high_watermark:
                    sim.fail(
                        f"acknowledged write not committed after healing: p{p} offset "
                        f"{ack.offset} >= leader b{record.leader} HW {rep.high_watermark}"
                    )
