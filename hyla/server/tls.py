"""HTTPS without a proxy in front: ``--ssl-certfile``, ``--ssl-keyfile`` (and its password), ``--ssl-ca-certs``
and ``--ssl-cert-reqs`` (vLLM's and uvicorn's flags), shared by ``hyla serve`` and ``hyla route``: the flags,
their check before anything loads, and ``uvicorn.Config``'s options from them."""

from __future__ import annotations

import argparse
import ssl
from typing import Any


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ssl-certfile", default=None, metavar="PATH",
                        help="Serve HTTPS with this certificate chain (PEM), and --ssl-keyfile (default: HTTP).")
    parser.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="The certificate's private key (PEM).")
    parser.add_argument("--ssl-keyfile-password", default=None, metavar="PASSWORD",
                        help="The password of an encrypted --ssl-keyfile (without it, an encrypted key is an error).")
    parser.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                        help="With --ssl-cert-reqs 1 or 2: the CA certificates clients' certificates are checked "
                             "against.")
    parser.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                        help="Client certificates (Python's ssl.CERT_*): 0 none asked (default), 1 checked where "
                             "given, 2 required.")


def tls_options(args: argparse.Namespace) -> dict[str, Any]:
    """``uvicorn.Config``'s TLS options from the flags (none without a certificate)."""
    if args.ssl_certfile is None:
        return {}
    return dict(ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                ssl_keyfile_password=args.ssl_keyfile_password, ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=args.ssl_cert_reqs)


def tls_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the TLS flags (they go together, and the files load as a server's TLS context), or
    None: checked before anything is loaded."""
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        return "--ssl-certfile and --ssl-keyfile go together"
    if args.ssl_certfile is None:
        return "--ssl-ca-certs, --ssl-cert-reqs and --ssl-keyfile-password need --ssl-certfile" \
            if args.ssl_ca_certs is not None or args.ssl_cert_reqs or args.ssl_keyfile_password is not None else None
    if args.ssl_cert_reqs and args.ssl_ca_certs is None:
        return "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (what a client's certificate is checked against)"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # (a password always given: an encrypted key without one is an error, not a prompt on the terminal)
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=args.ssl_keyfile_password or "")
        if args.ssl_ca_certs is not None:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        return f"cannot use the TLS certificate or key: {exc}"
    return None
