"""Test set-up: 4 virtual CPU devices before TensorFlow starts."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

import tfpar  # pylint: disable=g-import-not-at-top

NUM_TEST_DEVICES = 4
tfpar.configure_virtual_cpus(NUM_TEST_DEVICES)
