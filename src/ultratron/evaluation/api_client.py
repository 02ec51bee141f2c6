"""The few OpenAI API calls evaluation makes, over the standard library's HTTP client.

`ultratron eval --endpoint` needs three calls (completions, chat completions, the model list) and a
vLLM-style `/tokenize`. The `openai` package would do them too, but importing it (its pydantic
types) took 1.5–6 s of the command's start on this project's CPU, more than the scoring of a small
task; this client answers in plain dicts. What it keeps of a client library's behaviour:

- a request that fails for a reason that may pass (connection refused or reset, a timeout, HTTP 408,
  409, 429 or 5xx) is retried up to `max_retries` times, waiting 0.5 s, 1 s, 2 s, … (at most 8 s;
  a `Retry-After` header of at most 60 s is honoured), as the OpenAI clients do;
- a request that fails for good raises `APIError`, named like the OpenAI clients' error classes
  (`BadRequestError`, `AuthenticationError`, `NotFoundError`, `RateLimitError`,
  `InternalServerError`, `APIConnectionError`, `APITimeoutError`, …) with the server's message.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import orjson

RETRY_STATUS = (408, 409, 429)  # and every 5xx
ERROR_NAMES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 409: "ConflictError", 422: "UnprocessableEntityError", 429: "RateLimitError"}


class APIError(Exception):
    """A request that failed after its retries: `kind` is the OpenAI clients' name for the failure."""

    def __init__(self, kind: str, message: str, status: int | None = None):
        super().__init__(message)
        self.kind, self.status = kind, status


def _error_kind(status: int) -> str:
    return ERROR_NAMES.get(status, "InternalServerError" if status >= 500 else "APIStatusError")


def loads(body: bytes):
    """A JSON body, through orjson (a scoring answer's floats parse 4× faster than with the standard
    library); the standard library takes what orjson refuses, such as the NaN and Infinity that some
    servers write for a log-probability."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)


def _message(body: bytes, status: int) -> str:
    """The server's error message (OpenAI's {"error": {"message": ...}}), else the body's start."""
    try:
        error = json.loads(body).get("error")
        text = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        text = None
    return f"Error code: {status} - {text or body[:200].decode('utf-8', 'replace')}"


class Client:
    """POST/GET JSON under `base_url` (ending in /v1) with a bearer key, retried as the module says."""

    def __init__(self, base_url: str, api_key: str, timeout: float = 60.0, max_retries: int = 3):
        self.base_url, self.api_key = base_url.rstrip("/"), api_key
        self.timeout, self.max_retries = timeout, max_retries

    def post(self, path: str, body: dict) -> dict:
        return self._request("POST", path, json.dumps(body).encode())

    def get(self, path: str) -> dict:
        return self._request("GET", path, None)

    def _request(self, method: str, path: str, data: bytes | None) -> dict:
        url = path if path.startswith("http") else f"{self.base_url}/{path.lstrip('/')}"
        headers = {"Authorization": f"Bearer {self.api_key}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in range(self.max_retries + 1):
            wait = min(8.0, 0.5 * 2**attempt)
            try:
                request = urllib.request.Request(url, data=data, headers=headers, method=method)
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return loads(response.read())
            except urllib.error.HTTPError as err:
                body = err.read()
                failure = APIError(_error_kind(err.code), _message(body, err.code), err.code)
                if not (err.code in RETRY_STATUS or err.code >= 500):
                    raise failure from None
                after = err.headers.get("Retry-After", "") if err.headers else ""
                if after.replace(".", "", 1).isdigit() and float(after) <= 60:
                    wait = float(after)
            except TimeoutError as err:
                failure = APIError("APITimeoutError", f"Request timed out ({err})")
            except (urllib.error.URLError, ConnectionError) as err:
                reason = getattr(err, "reason", err)
                if isinstance(reason, TimeoutError):
                    failure = APIError("APITimeoutError", f"Request timed out ({reason})")
                else:
                    failure = APIError("APIConnectionError", f"Connection error ({reason})")
            except ValueError as err:  # an answer that is not JSON: a proxy's page, not the API
                raise APIError("APIResponseValidationError", f"the answer is not JSON ({err})") from None
            if attempt < self.max_retries:
                time.sleep(wait)
        raise failure
