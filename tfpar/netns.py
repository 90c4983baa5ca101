"""Private loopback-only networks for local multi-worker jobs.

TensorFlow's gRPC server listens on every interface (`0.0.0.0:port`),
whatever address `TF_CONFIG` gives. To keep a local job reachable from this
machine only, `tfpar launch` runs its workers in a new Linux network
namespace (made with `unshare --net --map-root-user`, no privileges needed)
whose only interface is loopback.

The namespace is also a PID namespace (`--pid --fork --kill-child`): the
launcher inside is its first process, and when that process ends, however
it ends, the kernel kills every process left in the namespace; `unshare`
kills it when `unshare` itself dies. So no worker outlives the job.
"""

import fcntl
import functools
import shutil
import socket
import struct
import subprocess

UNSHARE = ("unshare", "--net", "--map-root-user", "--pid", "--fork",
           "--kill-child")
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


@functools.lru_cache(maxsize=None)
def isolation_available():
  """Whether this machine lets an unprivileged user make a network namespace."""
  if shutil.which(UNSHARE[0]) is None:
    return False
  try:
    return subprocess.run(UNSHARE + ("true",), capture_output=True,
                          timeout=10).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


def bring_loopback_up():
  """Sets the `lo` interface up (a new namespace starts with it down)."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
    request = struct.pack("16sh", b"lo", 0)
    flags = struct.unpack("16sh", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
    fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))
