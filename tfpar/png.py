"""A PNG encoder for RGB uint8 arrays (zlib only: no TensorFlow, no PIL),
so that `tfpar monitor plot` and `tfpar plan --plot` draw without starting
TensorFlow."""

import struct
import zlib

import numpy as np


def _chunk(tag, data):
  return (struct.pack(">I", len(data)) + tag + data +
          struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))


def encode(image):
  """The PNG bytes of a (height, width, 3) uint8 array.

  Args:
    image: the RGB pixels.

  Example:

  >>> import numpy as np
  >>> encode(np.zeros((2, 3, 3), np.uint8))[:8]
  b'\\x89PNG\\r\\n\\x1a\\n'
  """
  image = np.ascontiguousarray(image, np.uint8)
  height, width, _ = image.shape
  rows = np.concatenate([np.zeros((height, 1), np.uint8),
                         image.reshape(height, width * 3)], axis=1)
  header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
  return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) +
          _chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)) +
          _chunk(b"IEND", b""))
