"""Every error the API answers, built in one place: OpenAI's error object as vLLM
sends it (``{"error": {"message", "type", "param", "code"}}``) with its status."""

from __future__ import annotations

from http import HTTPStatus

import msgspec
from aiohttp import web

# Seconds a 503 asks a client to wait: about what a restarted worker takes to be back.
RETRY_AFTER_S = 5

_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowed",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestEntityTooLarge",
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: "UnsupportedMediaType",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.NOT_IMPLEMENTED: "NotImplementedError",
}


class APIError(Exception):
    """Raised anywhere in a handler; answered as OpenAI's error object."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = HTTPStatus(status)
        self.param = param
        # NOTE: the error's type where vLLM names it otherwise than by status (its
        # framework's own refusals say the phrase: "Bad Request").
        self.type = type_ or _TYPES.get(self.status, self.status.phrase.replace(" ", ""))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.status.value}}

    def response(self) -> web.Response:
        # NOTE: a 503 is a pause (no worker yet, or one restarting): Retry-After tells
        # clients (the openai SDK honours it) when to try again rather than give up.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == HTTPStatus.SERVICE_UNAVAILABLE else None
        return web.Response(status=self.status.value, body=msgspec.json.encode(self.body()), content_type="application/json",
                            headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param)


def model_not_found(model: str) -> APIError:
    return APIError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "model")


def unavailable(why: str) -> APIError:
    return APIError(why, HTTPStatus.SERVICE_UNAVAILABLE)
