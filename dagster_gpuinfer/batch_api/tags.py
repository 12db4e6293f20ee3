"""The run tags a batch's Dagster run carries (set by the sensor, read by the API and the
k8s launcher). The queue tag is the one `GpuInferenceResource` reads for the pod's Kueue
queue (`dagster_gpuinfer.resource.RUN_QUEUE_TAG`)."""

BATCH_ID_TAG = "gpuinfer/batch_id"
TENANT_TAG = "gpuinfer/tenant"
QUEUE_TAG = "gpuinfer/kueue_queue"
