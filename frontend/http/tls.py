"""``--ssl-*``: the SSL context uvicorn builds for vLLM (``uvicorn.config.create_ssl_context``),
given to aiohttp's TCPSite: a TLS server context with the certificate chain, client
certificates verified as ``--ssl-cert-reqs`` asks (``ssl.CERT_*``) against
``--ssl-ca-certs``, and ``--ssl-ciphers`` set when given (TLS 1.3's suites are not
OpenSSL's cipher list: ``set_ciphers`` leaves them as they are, as in uvicorn)."""

from __future__ import annotations

import ssl

from frontend.config import FrontendConfig


class TLSConfigError(ValueError):
    """A key, certificate or CA file that cannot be used, named."""


def ssl_context(config: FrontendConfig) -> ssl.SSLContext | None:
    """None (plain HTTP) unless --ssl-certfile is given."""
    if not config.ssl_certfile:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        key = f" with --ssl-keyfile {config.ssl_keyfile}" if config.ssl_keyfile else ""
        raise TLSConfigError(f"cannot load --ssl-certfile {config.ssl_certfile}{key}: {e}") from None
    if config.ssl_ciphers:  # NOTE: as uvicorn: an empty list is none given
        try:
            ctx.set_ciphers(config.ssl_ciphers)
        except ssl.SSLError as e:
            raise TLSConfigError(f"--ssl-ciphers {config.ssl_ciphers!r} selects no cipher: {e}") from None
    ctx.verify_mode = ssl.VerifyMode(config.ssl_cert_reqs)
    if config.ssl_ca_certs:
        try:
            ctx.load_verify_locations(config.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise TLSConfigError(f"cannot load --ssl-ca-certs {config.ssl_ca_certs}: {e}") from None
    return ctx
