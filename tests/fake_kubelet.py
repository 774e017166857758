"""kubelet's side of the device plugin API, played from the same vendored api.proto.

What it does is what kubelet's device manager does with a plugin: serve Registration on
``kubelet.sock``; on Register, dial the plugin's socket in the same directory and hold a
ListAndWatch stream open; on restart, wipe the directory's sockets and create its own
anew.  Everything runs over unix sockets in a short temporary directory (a socket path
must fit in 108 bytes, which pytest's tmp_path may not).
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from topoagent.cluster.deviceplugin import api_pb2, api_pb2_grpc

WAIT_S = 20.0


class FakeKubelet(api_pb2_grpc.RegistrationServicer):
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))
        self.registrations: queue.Queue[api_pb2.RegisterRequest] = queue.Queue()
        self.listings: queue.Queue[list[api_pb2.Device]] = queue.Queue()
        self.server: grpc.Server | None = None
        self.channels: list[grpc.Channel] = []
        self.endpoint: str | None = None

    @property
    def socket(self) -> Path:
        return self.dir / "kubelet.sock"

    def start(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self.server = server

    def Register(self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext) -> api_pb2.Empty:
        self.endpoint = request.endpoint
        self.registrations.put(request)
        channel = grpc.insecure_channel(f"unix://{self.dir / request.endpoint}")
        self.channels.append(channel)
        stream = api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty())
        threading.Thread(target=self._watch, args=(stream,), daemon=True).start()
        return api_pb2.Empty()

    def _watch(self, stream) -> None:
        try:
            for response in stream:
                self.listings.put(list(response.devices))
        except grpc.RpcError:
            pass  # the plugin went away or kubelet restarted: the stream ends

    def plugin(self) -> api_pb2_grpc.DevicePluginStub:
        """A client for the registered plugin, as kubelet's device manager holds one."""
        assert self.endpoint is not None, "no plugin registered"
        channel = grpc.insecure_channel(f"unix://{self.dir / self.endpoint}")
        self.channels.append(channel)
        return api_pb2_grpc.DevicePluginStub(channel)

    def next_registration(self, timeout: float = WAIT_S) -> api_pb2.RegisterRequest:
        return self.registrations.get(timeout=timeout)

    def wait_listing(self, predicate, timeout: float = WAIT_S) -> list[api_pb2.Device]:
        """The first listing the plugin pushes that satisfies ``predicate``."""
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no listing matched in {timeout} s; got {len(seen)}: {[[(d.ID[-4:], d.health) for d in s] for s in seen]}")
            try:
                devices = self.listings.get(timeout=left)
            except queue.Empty:
                continue
            seen.append(devices)
            if predicate(devices):
                return devices

    def restart(self) -> None:
        """What a kubelet restart looks like to a plugin: every socket in the directory
        removed, then kubelet's own created again (a new file)."""
        self.stop_server()
        for path in self.dir.iterdir():
            if path.is_socket():
                path.unlink()
        self.start()

    def stop_server(self) -> None:
        for channel in self.channels:
            channel.close()
        self.channels.clear()
        if self.server is not None:
            self.server.stop(grace=None).wait()
            self.server = None

    def close(self) -> None:
        self.stop_server()
        shutil.rmtree(self.dir, ignore_errors=True)


class PluginProcess:
    def __init__(self, proc: subprocess.Popen, log_path: Path):
        self.proc = proc
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"device-plugin ignored SIGTERM for {timeout} s:\n{self.log()[-2000:]}") from None


def start_plugin(tmp: Path, kubelet: FakeKubelet, agent_url: str, *, extra: list[str] | None = None) -> PluginProcess:
    args = [sys.executable, "-P", "-m", "topoagent", "device-plugin", "--plugin-dir", str(kubelet.dir),
            "--agent-url", agent_url, "--poll-interval", "0.2", "--kube-api", "off", *(extra or [])]
    log_path = tmp / f"plugin-{time.monotonic_ns()}.log"
    env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "NODE_NAME")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, env=env)
    return PluginProcess(proc, log_path)
