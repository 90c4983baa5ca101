"""tfpar: tensor, pipeline and ZeRO parallelism for TensorFlow / Keras 3.

Example:

>>> import tfpar
>>> strategy = tfpar.DataParallelStrategy(tfpar.Mesh({"data": -1}))
"""

from tfpar import engine
from tfpar.callbacks import BackupAndRestore
from tfpar.callbacks import ModelCheckpoint
from tfpar.cluster import ClusterLayout
from tfpar.data_parallel import DataParallelStrategy
from tfpar.local_devices import configure_virtual_cpus
from tfpar.mesh import Mesh
from tfpar.mesh import MeshAxis

__version__ = "0.1.0"

__all__ = [
    "BackupAndRestore", "ClusterLayout", "DataParallelStrategy", "Mesh",
    "MeshAxis", "ModelCheckpoint", "configure_virtual_cpus", "engine",
]
