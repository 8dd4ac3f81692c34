"""How a model runs: the cached-model runner, compiled steps, attention kernels, CPU paths and the hardware
measurement. Imports nothing above it."""
