"""Names of the environment variables tfpar reads.

They live here, in a module that imports nothing, so that the bottom layer
(local devices) and the top one (`tfpar launch`, recipes) share them
without importing each other.

Example:

>>> from tfpar import environment
>>> environment.DEVICES_PER_WORKER_ENV
'TFPAR_DEVICES_PER_WORKER'
"""

# Virtual CPUs per worker that `tfpar launch --devices-per-worker N` asks
# each worker for; `tfpar.Mesh` honours it before TensorFlow starts.
DEVICES_PER_WORKER_ENV = "TFPAR_DEVICES_PER_WORKER"

# The recipe `tfpar launch --recipe NAME` chose; read by `tfpar.from_recipe()`.
RECIPE_ENV = "TFPAR_RECIPE"

# `tfpar launch --elastic`: the restart count (0 on the first run), and a
# folder where a worker preempted by SIGTERM leaves a mark for the launcher.
ELASTIC_RESTART_ENV = "TFPAR_ELASTIC_RESTART"
ELASTIC_STATE_DIR_ENV = "TFPAR_ELASTIC_STATE_DIR"
