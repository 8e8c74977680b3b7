"""A cluster on an etcd at etcd's own defaults (``--max-txn-ops=128``), as one "run
elsewhere" has unless someone changed it (docs/DEPLOY.md): a broker hosting 140 partition
replicas dies, and its leaderships move; a topic of 200 partitions is created. The
controller's transactions carried up to 1,000 partition records: etcd refused the
fail-over ("too many operations in txn request"), the controller retried for ever and
the dead broker's partitions stayed led by it; the creation failed (found by an audit).
"""

from __future__ import annotations

from pathlib import Path

from tests.support.cluster import TestCluster, wait_for
from tidelog.v1 import controller_pb2

ETCD_DEFAULT_MAX_TXN_OPS = ["--max-txn-ops=128"]  # etcd's own default (later flag wins)


def test_a_broker_failure_moves_leaders_with_an_etcd_at_its_default_settings(
    tmp_path: Path,
) -> None:
    with TestCluster(tmp_path / "c", etcd_args=ETCD_DEFAULT_MAX_TXN_OPS) as cluster:
        cluster.start_broker(0)
        cluster.start_broker(1)
        cluster.start_controller(1)
        cluster.wait_brokers([0, 1])
        # Two topics of 70 partitions: each creation fits in 128 operations.
        for name in ("a", "b"):
            cluster.create_topic(name, 70, 2)
        led_by_1 = sum(p.leader == 1 for t in ("a", "b") for p in cluster.partitions(t))
        assert led_by_1 > 0

        cluster.kill(cluster.brokers[1])

        def stranded() -> list[tuple[str, int, int]]:
            return [
                (t, p.partition, p.leader)
                for t in ("a", "b")
                for p in cluster.partitions(t)
                if p.leader != 0
            ]

        try:
            wait_for(lambda: not stranded(), 20.0, "every partition led by broker 0")
        except AssertionError:
            left = stranded()
            raise AssertionError(
                f"{len(left)} of 140 partitions still led by the dead broker 1 twenty seconds "
                f"after it died, e.g. {left[:3]}; controller log: "
                f"{cluster.controllers[1].log_tail()[-400:]}"
            ) from None


def test_creating_a_topic_of_200_partitions_with_an_etcd_at_its_default_settings(
    tmp_path: Path,
) -> None:
    """The same etcd: a 200-partition topic (the controller's MAX_PARTITIONS_PER_TOPIC is
    4,000) is refused INVALID_REQUEST 'too many operations in txn request'."""
    with TestCluster(tmp_path / "c", etcd_args=ETCD_DEFAULT_MAX_TXN_OPS) as cluster:
        cluster.start_broker(0)
        cluster.start_controller(1)
        cluster.wait_brokers([0])
        response = cluster.api.CreateTopics(
            controller_pb2.CreateTopicsRequest(
                topics=[
                    controller_pb2.CreatableTopic(
                        name="big", num_partitions=200, replication_factor=1
                    )
                ],
                timeout_ms=20_000,
            ),
            timeout=40,
        )
        (result,) = response.topics
        assert result.error.code == 0, result.error
