"""One `APIRouter` per resource of OpenAI's API: `files` (`/v1/files`) and `batches`
(`/v1/batches`). `create_app` (app.py) includes both."""

from dagster_gpuinfer.batch_api.schemas import ErrorResponse

# The error answers every authenticated route can give, documented once per router.
ERROR_RESPONSES: dict[int | str, dict] = {
    400: {"model": ErrorResponse, "description": "The request is not valid; the message says why."},
    401: {"model": ErrorResponse, "description": "The API key is missing, unknown or revoked."},
    404: {"model": ErrorResponse, "description": "No such object for this key's tenant."},
    429: {
        "model": ErrorResponse,
        "description": "A rate limit or quota of the tenant is reached; the message names "
        "it, the Retry-After header says when to try again.",
        "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds."}},
    },
}
