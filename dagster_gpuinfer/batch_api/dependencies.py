"""What a route depends on: the service (from `app.state`) and the tenant a key belongs to.

Routes declare `service: ServiceDep` and `tenant: TenantDep`; tests can swap either with
`app.dependency_overrides`. The bearer token is read by FastAPI's own `HTTPBearer` (which
also puts the scheme in the OpenAPI document); `auto_error=False` so that a missing or
malformed header is answered in OpenAI's error shape below, not FastAPI's 403. The key is
checked before the route's body is read, by the `AuthenticateFirst` middleware; this
dependency hands the route the tenant it found.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from dagster_gpuinfer.batch_api.authentication import KEY_REFUSED_MESSAGE
from dagster_gpuinfer.batch_api.service import ApiError, BatchService
from dagster_gpuinfer.batch_api.store import Tenant

_bearer = HTTPBearer(auto_error=False, description="An API key: `sk-gpi-<key id>.<secret>`.")


def get_service(request: Request) -> BatchService:
    """The service `create_app` put on `app.state`."""
    return request.app.state.service


ServiceDep = Annotated[BatchService, Depends(get_service)]


def authenticated_tenant(
    request: Request,
    service: ServiceDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Tenant:
    """The tenant of the request's bearer key: the one `AuthenticateFirst` found before the
    body was read (authentication.py), or, in an app built without it, the store's answer.

    Raises:
        ApiError: 401 when the key is missing, malformed, unknown or revoked.
    """
    found = getattr(request.state, "tenant", None)
    if found is None and credentials is not None:
        found = service.store.authenticate(credentials.credentials)
    if found is None:
        raise ApiError(401, KEY_REFUSED_MESSAGE, code="invalid_api_key")
    return found


TenantDep = Annotated[Tenant, Depends(authenticated_tenant)]
