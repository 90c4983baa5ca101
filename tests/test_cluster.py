"""TF_CONFIG and cluster validation: every rule is a ValueError naming it."""

import json
import socket

import pytest

import tfpar
from tfpar import cluster as cluster_lib


def _config(cluster=None, task=None):
  return json.dumps({
      "cluster": cluster or {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
      "task": task or {"type": "worker", "index": 0}})


def test_valid_tf_config():
  assert cluster_lib.parse_tf_config(_config()) == (
      {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "worker", 0)


@pytest.mark.parametrize("text, message", [
    ('{"cluster": {"worker": ["a:1"]}, "task": ', r"not valid JSON.*line 1"),
    ("[1, 2]", r"must be a JSON object"),
    (json.dumps({"task": {"type": "worker", "index": 0}}),
     r"no 'cluster' entry"),
    (json.dumps({"cluster": {"worker": ["127.0.0.1:1"]}}), r"no 'task' entry"),
    (_config(task={"type": "worker"}), r"'task' must be an object with "
     r"'type' and 'index'"),
    (_config(task={"type": "worker", "index": 2}),
     r"Task index 2 is out of range for job 'worker'.*valid: 0..1"),
    (_config(task={"type": "worker", "index": "0"}),
     r"task index must be an integer.*'0'"),
    (_config(task={"type": "chef", "index": 0}),
     r"Task type 'chef' is not a job of the cluster"),
    (_config(cluster={"chief": ["127.0.0.1:1", "127.0.0.1:2"],
                      "worker": ["127.0.0.1:3"]}),
     r"at most one 'chief' task.*127.0.0.1:1"),
    (_config(cluster={"worker": ["127.0.0.1"]}),
     r"cluster\['worker'\]\[0\] must be a 'host:port' address"),
    (_config(cluster={"worker": ["127.0.0.1:99999"]}), r"port in 1-65535"),
    (_config(cluster={"worker": []}), r"non-empty list"),
    (_config(cluster={"worker": ["127.0.0.1:5", "127.0.0.1:5"]}),
     r"used by both worker:0 and worker:1"),
    (_config(cluster={"ps": ["127.0.0.1:5"]}, task={"type": "ps", "index": 0}),
     r"no 'chief' or 'worker' job"),
])
def test_bad_tf_config_is_value_error(text, message):
  with pytest.raises(ValueError, match=message):
    cluster_lib.parse_tf_config(text)


def test_bad_tf_config_fails_before_any_work(monkeypatch):
  monkeypatch.setenv("TF_CONFIG", "{not json")
  with pytest.raises(ValueError, match=r"TF_CONFIG is not valid JSON"):
    tfpar.Mesh.from_cluster_resolver()
  with pytest.raises(ValueError, match=r"TF_CONFIG is not valid JSON"):
    tfpar.DataParallelStrategy()


def test_ipv6_and_hostnames_are_valid_addresses():
  cluster = {"worker": ["[::1]:2222", "node-7.example:2223"]}
  assert cluster_lib.validate_cluster_spec(cluster, "worker", 1) == cluster


def test_own_port_in_use_is_a_value_error_before_tf_starts_a_server(
    monkeypatch):
  """Was: UnknownError "Could not start gRPC server", naming no port."""
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    monkeypatch.setenv("TF_CONFIG", _config(
        cluster={"worker": [f"127.0.0.1:{port}", "127.0.0.1:2223"]}))
    message = (rf"Port {port} of worker:0 \(address 127.0.0.1:{port}\) is "
               r"already in use on this machine")
    with pytest.raises(ValueError, match=message):
      tfpar.Mesh.from_cluster_resolver()
    with pytest.raises(ValueError, match=message):
      tfpar.DataParallelStrategy()
  # Free again: the same cluster now makes a mesh.
  assert tfpar.Mesh.from_cluster_resolver().size == 2 * len(
      tfpar.Mesh().devices)
