"""The ASGI entry point, for an ASGI server should one be chosen (docs/deployment.md serves
WSGI with gunicorn). Production unless told otherwise, as config/wsgi.py."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")

from django.core.asgi import get_asgi_application

application = get_asgi_application()
