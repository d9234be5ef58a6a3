"""Throwaway ``redis-server`` processes on loopback ports: one node, or a Redis Cluster of N masters with
R replicas each (for the tests, the benches and trying the cluster tier locally).

The cluster is formed with plain cluster commands (ADDSLOTSRANGE, MEET, REPLICATE), so only the
Debian ``redis-server`` package (Redis >= 7) is needed. Nodes keep no data on disk (no RDB, no AOF);
only their ``nodes-<port>.conf`` survives a restart, so a killed node restarted on its port rejoins
the cluster with its identity (a killed master whose replica was promoted comes back as its replica).

Run ``python -m semkv.store.redis_process --masters 3 --replicas 1`` to start one and print its URL.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from semkv.processes import free_port

SLOTS = 16384


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise OSError("redis-server is not installed (apt-get install -y redis-server redis-tools)")
    return binary


def wait_until(check: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> None:
    """Call ``check()`` until it is truthy; TimeoutError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(interval)
    raise TimeoutError(
        f"timed out after {timeout} s waiting for {what}" + (f" (last error: {last})" if last else "")
    )


class PortTaken(RuntimeError):
    """redis-server exited at start: its port (picked free a moment before) was taken meanwhile."""


class RedisNodeProcess:
    """One ``redis-server`` on ``127.0.0.1:port`` without persistence; ``extra``: more server arguments.

    ``start`` / ``stop`` (SIGKILL) / ``pause`` (SIGSTOP) / ``resume`` (SIGCONT) simulate outages on the same port.
    """

    def __init__(self, workdir: Path, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.workdir = Path(workdir)
        self.extra = tuple(extra)
        self.proc: subprocess.Popen | None = None

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, timeout: float = 1.0) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),  # one attempt: the callers poll
        )

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(self.workdir), *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client(0.5)

        def answering() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:  # e.g. the port was taken since it was picked
                raise PortTaken(f"redis-server on port {self.port} exited with {self.proc.returncode}")
            return bool(client.ping())

        try:
            wait_until(answering, timeout, f"redis-server on port {self.port}")
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGKILL (no shutdown, no goodbye to the cluster) and reap."""
        if self.running:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


@dataclass
class ClusterNodeInfo:
    """One line of CLUSTER NODES: id, ``host:port``, role, the master's id (replicas), flags."""

    id: str
    name: str
    master: bool
    master_id: str | None
    failed: bool
    slot_ranges: list[tuple[int, int]]

    @property
    def slots(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.slot_ranges)


def cluster_nodes(client: redis.Redis) -> list[ClusterNodeInfo]:
    """CLUSTER NODES of the node ``client`` talks to, parsed."""
    raw = client.execute_command("CLUSTER", "NODES")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    nodes = []
    for line in text.strip().splitlines():
        parts = line.split()
        flags = parts[2].split(",")
        ranges = []
        for r in parts[8:]:
            if r.startswith("["):  # a slot being imported / migrated
                continue
            lo, _, hi = r.partition("-")
            ranges.append((int(lo), int(hi or lo)))
        nodes.append(
            ClusterNodeInfo(
                id=parts[0],
                name=parts[1].split("@")[0],
                master="master" in flags,
                master_id=None if parts[3] == "-" else parts[3],
                failed="fail" in flags or "fail?" in flags,
                slot_ranges=ranges,
            )
        )
    return nodes


class LocalRedisCluster:
    """A Redis Cluster of ``masters`` masters with ``replicas`` replicas each on loopback ports.

    node_timeout_ms: ``cluster-node-timeout`` (a failed master's replica is promoted a few of these after
    it stops answering). Every node runs with ``cluster-require-full-coverage no`` (the other masters keep
    serving while one's slots are down) and ``cluster-replica-validity-factor 0`` (a replica always may
    take over). ``url``: the masters as seed nodes, ``redis://h:p1,h:p2,h:p3/0``.
    """

    def __init__(
        self, workdir: Path, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000
    ) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError(f"need masters >= 1 and replicas >= 0, got {masters}, {replicas}")
        if node_timeout_ms < 100:
            raise ValueError(f"node_timeout_ms must be >= 100, got {node_timeout_ms}")
        self.workdir = Path(workdir)
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.bus_ports: dict[str, int] = {}
        self.nodes = [self._new_node() for _ in range(masters * (1 + replicas))]

    def _new_node(self) -> RedisNodeProcess:
        """A cluster node on fresh free ports (not started)."""
        port, bus_port = free_port(), free_port()
        extra = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf")
        extra += ("--cluster-port", str(bus_port))  # the default, port + 10000, may be over 65535
        extra += ("--cluster-node-timeout", str(self.node_timeout_ms))
        extra += ("--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0")
        extra += ("--repl-diskless-sync-delay", "0")  # a (re)joining replica syncs at once, not after 5 s
        node = RedisNodeProcess(self.workdir, port, extra)
        self.bus_ports[node.name] = bus_port
        return node

    @property
    def url(self) -> str:
        seeds = ",".join(n.name for n in self.nodes[: self.masters])
        return f"redis://{seeds}/0"

    def node(self, name: str) -> RedisNodeProcess:
        return next(n for n in self.nodes if n.name == name)

    def start(self, timeout: float = 60.0) -> None:
        """Start every node, assign slots to the first ``masters``, join them, attach the replicas, wait
        healthy; on any failure the nodes started are stopped again."""
        try:
            self._form(timeout)
        except BaseException:
            self.stop()
            raise

    def _form(self, timeout: float) -> None:
        for i in range(len(self.nodes)):
            for attempt in range(3):
                try:
                    self.nodes[i].start()
                    break
                except PortTaken:
                    if attempt == 2:
                        raise
                    self.nodes[i] = self._new_node()  # another process took a port: pick new ones
        first, *others = self.nodes
        clients = [n.client() for n in self.nodes]
        try:
            for i, client in enumerate(clients[: self.masters]):
                lo, hi = i * SLOTS // self.masters, (i + 1) * SLOTS // self.masters - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            for node in others:
                clients[0].execute_command(
                    "CLUSTER", "MEET", "127.0.0.1", node.port, self.bus_ports[node.name]
                )
            ids = [c.execute_command("CLUSTER", "MYID") for c in clients]
            ids = [i.decode() if isinstance(i, bytes) else str(i) for i in ids]
            wait_until(
                lambda: all(len(cluster_nodes(c)) == len(self.nodes) for c in clients),
                timeout,
                "every node to know every other",
            )
            for r in range(self.replicas):
                for m in range(self.masters):
                    replica = self.masters * (1 + r) + m
                    clients[replica].execute_command("CLUSTER", "REPLICATE", ids[m])
        finally:
            for client in clients:
                client.close()
        self.wait_healthy(timeout)

    def topology(self) -> list[ClusterNodeInfo]:
        """CLUSTER NODES as seen by the first live node."""
        view = next(self._views(), None)
        if view is None:
            raise RuntimeError("no cluster node is running")
        return view

    def master_names(self) -> list[str]:
        """``host:port`` of the masters that serve slots and are not failed."""
        return [n.name for n in self.topology() if n.master and n.slots and not n.failed]

    def master_of_slot(self, slot: int) -> str:
        """``host:port`` of the master serving hash slot ``slot``."""
        for n in self.topology():
            if n.master and not n.failed and any(lo <= slot <= hi for lo, hi in n.slot_ranges):
                return n.name
        raise LookupError(f"no live master serves slot {slot}")

    def replica_of(self, master: str) -> str | None:
        nodes = self.topology()
        by_name = {n.name: n for n in nodes}
        return next((n.name for n in nodes if n.master_id == by_name[master].id and not n.failed), None)

    def healthy(self) -> bool:
        """Every running node: cluster_state ok, the same masters, each master with its replicas linked."""
        running = [n for n in self.nodes if n.running]
        views = []
        for node in running:
            client = node.client()
            try:
                info = client.execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in text:
                    return False
                views.append(
                    sorted(n.name for n in cluster_nodes(client) if n.master and n.slots and not n.failed)
                )
                role = client.info("replication")
                if role.get("role") == "slave" and role.get("master_link_status") != "up":
                    return False
            finally:
                client.close()
        if not views or any(v != views[0] for v in views):
            return False
        masters = views[0]
        replicas = sum(
            1 for n in self.topology() if not n.master and not n.failed and n.master_id is not None
        )
        return len(masters) == self.masters and replicas == len(running) - self.masters

    def wait_healthy(self, timeout: float = 60.0) -> None:
        wait_until(self.healthy, timeout, "the Redis Cluster to be healthy", interval=0.1)

    def kill(self, name: str) -> None:
        """SIGKILL one node (its data is gone; its nodes.conf stays for a restart)."""
        self.node(name).stop()

    def restart(self, name: str) -> None:
        self.node(name).start()

    def _views(self) -> Iterator[list[ClusterNodeInfo]]:
        """CLUSTER NODES as seen by each live node that answers, in node order."""
        for node in self.nodes:
            if not node.running:
                continue
            client = node.client()
            try:
                view = cluster_nodes(client)
            except (redis.RedisError, OSError):
                continue
            finally:
                client.close()
            yield view

    def wait_promoted(self, dead_master: str, timeout: float = 60.0) -> str:
        """Wait until every live node sees another node serve the slots ``dead_master`` had.

        Returns that node's ``host:port``. Waiting for all views (not the first node's) means a client
        that reads the slot map from any live node afterwards sees the promotion.
        """
        before = set(self.master_names()) | {dead_master}
        found: list[str] = []

        def promoted() -> bool:
            news = [
                {n.name for n in view if n.master and n.slots and not n.failed} - before
                for view in self._views()
            ]
            agreed = set.intersection(*news) if news else set()
            found[:] = sorted(agreed)
            return bool(agreed)

        wait_until(
            promoted, timeout, f"every live node to see a replica of {dead_master} promoted", interval=0.1
        )
        return found[0]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="start a local Redis Cluster on loopback ports")
    parser.add_argument("--masters", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--node-timeout-ms", type=int, default=1000)
    parser.add_argument("--dir", default=None, help="folder for nodes.conf files (default: a temp folder)")
    args = parser.parse_args(argv)
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="semkv-redis-cluster-"))
    cluster = LocalRedisCluster(workdir, args.masters, args.replicas, args.node_timeout_ms)
    cluster.start()
    print(cluster.url, flush=True)  # noqa: T201 - the command's output
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
