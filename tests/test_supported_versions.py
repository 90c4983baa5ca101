"""The supported TensorFlow / Keras versions: setup.cfg's bounds, the pair
CI's second environment tests (.ci/oldest-versions.txt), and this one."""

import configparser
import importlib.metadata
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bounds():
  config = configparser.ConfigParser()
  config.read(os.path.join(ROOT, "setup.cfg"))
  bounds = {}
  for line in config["options"]["install_requires"].splitlines():
    match = re.fullmatch(r"(tensorflow|keras)>=([\d.]+),<([\d.]+)",
                         line.strip())
    if match:
      bounds[match[1]] = (match[2], match[3])
  return bounds


def _version(text):
  parts = [int(part) for part in re.findall(r"\d+", text)[:3]]
  return tuple(parts + [0] * (3 - len(parts)))


def test_setup_cfg_bounds_tensorflow_and_keras_on_both_sides():
  assert set(_bounds()) == {"tensorflow", "keras"}


def test_ci_tests_the_lower_bounds():
  with open(os.path.join(ROOT, ".ci", "oldest-versions.txt")) as f:
    pins = dict(re.findall(r"^(\w+)==([\d.]+)$", f.read(), flags=re.M))
  assert {name: _version(v) for name, v in pins.items()} == {
      name: _version(low) for name, (low, _) in _bounds().items()}


def test_the_installed_versions_are_supported():
  for name, (low, high) in _bounds().items():
    installed = _version(importlib.metadata.version(name))
    assert _version(low) <= installed < _version(high), (name, installed)
