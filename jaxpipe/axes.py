"""The mesh's axis names, defined once (pure Python): ``pipe`` holds parallel pipelines (AvgPipe), ``data``
replicates a pipeline (data parallelism; CyclicDataParallel's workers), ``stage`` carries the pipeline."""
PIPE, DATA, STAGE = "pipe", "data", "stage"
AXES = (PIPE, DATA, STAGE)
DP_AXES = (PIPE, DATA)
