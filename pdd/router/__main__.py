"""The PDD router: one front door for P (prefill), RLD (RelayDecode) and MD (MainDecode).

    python -m pdd.router --prefill http://P:30000 8998 --relay http://RLD:30001 \\
        --main http://MD:30002 7500 --port 8000 --control-host 10.0.0.1 --control-port 7600

Each request goes P->RLD->MD (`--path pdd`, default), P->RLD (`relay`) or P->MD (`main`); a
request's own "pdd_path" field overrides the default. The control secret comes from
--secret-file or $PDD_CONTROL_SECRET and must match the MD servers'.
"""

from __future__ import annotations

import logging

from aiohttp import web

from pdd.launch.cli import command_parser
from pdd.router.app import make_app
from pdd.router.config import build_parser, config_from_args
from pdd.router.tokenizer import TokenizerError


def main(argv: list[str] | None = None) -> None:
    parser = build_parser(command_parser("pdd.router", __doc__))
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        config.advertise_host  # noqa: B018  (fails early on a wildcard host without an advertise)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = make_app(config)  # loads --tokenizer, if given
    except TokenizerError as err:
        parser.error(str(err))
    web.run_app(app, host=config.host, port=config.port, access_log=None)


if __name__ == "__main__":
    main()
