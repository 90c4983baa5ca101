"""Ports for local multi-worker jobs: picking free ones, checking our own.

No TensorFlow here: `tfpar launch` uses it before any worker starts.
"""

import contextlib
import random
import socket

_FIRST_PORT = 20000  # free_ports' lowest port.


def free_ports(count, host="127.0.0.1"):
  """Returns `count` distinct ports that are free on `host` right now.

  They are taken below the kernel's ephemeral range
  (`net.ipv4.ip_local_port_range`), from which the kernel picks the local
  ports of outgoing connections: a port from that range could be taken by a
  worker's own connection to a peer before the worker that owns the port
  starts listening ("connection refused" under load).

  Args:
    count: how many ports.
    host: the address they must be free on.

  Returns:
    A list of `count` distinct port numbers.

  Example:

  >>> len(set(free_ports(3)))
  3
  """
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  candidates = list(range(_FIRST_PORT, ephemeral_range()[0]))
  random.shuffle(candidates)
  ports = []
  with contextlib.ExitStack() as held:  # Held until all are chosen.
    for port in candidates + [0] * count:  # Then any port the kernel gives.
      if len(ports) == count:
        break
      sock = socket.socket(family, socket.SOCK_STREAM)
      try:
        sock.bind((host, port))
      except OSError:
        sock.close()
        continue
      held.enter_context(sock)
      ports.append(sock.getsockname()[1])
  return ports


def ephemeral_range():
  """The kernel's `(first, last)` ports for outgoing connections.

  Example:

  >>> first, last = ephemeral_range()
  >>> 0 < first <= last <= 65535
  True
  """
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      first, last = (int(v) for v in f.read().split())
    return first, last
  except (OSError, ValueError):
    return _FIRST_PORT, 65535  # Unknown: free_ports lets the kernel choose.


def check_port_free(address, task="this task"):
  """Raises a ValueError when `address`'s port is taken on this machine.

  TensorFlow's gRPC server listens on every interface, so the port must be
  free on all of them; otherwise TF fails later with "Could not start gRPC
  server", naming no port.

  Args:
    address: this task's `'host:port'` address from the cluster spec.
    task: how the message names the task, e.g. `"worker:1"`.

  Raises:
    ValueError: the port is in use (or not allowed) here.

  Example:

  >>> with socket.socket() as sock:
  ...   sock.bind(("127.0.0.1", 0))
  ...   sock.listen()
  ...   check_port_free(f"127.0.0.1:{sock.getsockname()[1]}")  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  ValueError: Port ... of this task (address 127.0.0.1:...) is already in use on this machine...
  """
  host, _, port = address.rpartition(":")
  family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as sock:
    # As gRPC does, so that connections left in TIME_WAIT do not count.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0",
                 int(port)))
    except OSError as e:
      raise ValueError(
          f"Port {port} of {task} (address {address}) is already in use on "
          f"this machine ({e.strerror}); TensorFlow's server must listen on "
          f"it. Give each task a free port in TF_CONFIG (tfpar launch picks "
          f"them itself).") from None
