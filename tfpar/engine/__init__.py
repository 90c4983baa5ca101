"""The strategy engine shared by every tfpar strategy."""

from tfpar.engine.extended import MeshExtended
from tfpar.engine.extended import next_collective_key_base
from tfpar.engine.strategy import MeshStrategy
