"""A 5x7 bitmap font for tfpar's pictures: the planner's chart and the
pipeline swimlane (no font files, no PIL).

Upper-case letters, digits and the punctuation the chart uses; lower case
prints as upper case, unknown characters as a blank.
"""

import numpy as np

# Each glyph: 7 rows of 5 pixels, '#' on.
_GLYPHS = {
    "A": ".###. #...# #...# ##### #...# #...# #...#",
    "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.",
    "D": "####. #...# #...# #...# #...# #...# ####.",
    "E": "##### #.... #.... ####. #.... #.... #####",
    "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####",
    "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#",
    "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#",
    "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.",
    "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#",
    "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.",
    "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.",
    "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.",
    "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..",
    "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "####. ....# ....# .###. ....# ....# ####.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ...#. .##..",
    " ": "..... ..... ..... ..... ..... ..... .....",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...",
    "-": "..... ..... ..... .###. ..... ..... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "/": "..... ....# ...#. ..#.. .#... #.... .....",
    "%": "##..# ##.#. ...#. ..#.. .#... .#.## #..##",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    "=": "..... ..... ##### ..... ##### ..... .....",
    "*": "..... ..#.. #.#.# .###. #.#.# ..#.. .....",
    "'": "..#.. ..#.. .#... ..... ..... ..... .....",
}
WIDTH, HEIGHT = 5, 7
ADVANCE = WIDTH + 1  # One blank column between characters.


def _bitmap(char):
  rows = _GLYPHS.get(char.upper(), _GLYPHS[" "]).split()
  return np.array([[c == "#" for c in row] for row in rows], bool)


_BITMAPS = {char: _bitmap(char) for char in _GLYPHS}


def text_width(text, scale=1):
  """Pixels `text` takes at `scale` (no trailing blank column).

  Example:

  >>> from tfpar.bitmap_font import text_width
  >>> text_width("DP64"), text_width("DP64", scale=2)
  (23, 46)
  """
  return max(len(text) * ADVANCE - 1, 0) * scale


def draw_text(image, text, top, left, color, scale=1):
  """Draws `text` into an RGB uint8 array, clipped to the image.

  Args:
    image: a (height, width, 3) uint8 array, changed in place.
    text: the string.
    top: the row of the text's top edge.
    left: the column of its left edge.
    color: an RGB triple.
    scale: pixels per font pixel.

  Example:

  >>> import numpy as np
  >>> from tfpar.bitmap_font import draw_text
  >>> image = np.full((9, 30, 3), 255, np.uint8)
  >>> draw_text(image, "ZERO-1", 1, 1, (0, 0, 0))
  >>> int((image[..., 0] == 0).sum()) > 0
  True
  """
  color = np.asarray(color, np.uint8)
  for position, char in enumerate(text):
    bitmap = _BITMAPS.get(char.upper(), _BITMAPS[" "])
    glyph = np.kron(bitmap, np.ones((scale, scale), bool))
    y, x = top, left + position * ADVANCE * scale
    height = min(glyph.shape[0], image.shape[0] - y)
    width = min(glyph.shape[1], image.shape[1] - x)
    if y < 0 or x < 0 or height <= 0 or width <= 0:
      continue
    region = image[y:y + height, x:x + width]
    region[glyph[:height, :width]] = color
