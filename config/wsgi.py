"""The WSGI entry point gunicorn serves (config/gunicorn.py). Production unless told
otherwise: a server started without DJANGO_SETTINGS_MODULE must refuse to run on weak or
missing settings, never fall back to the demo's SQLite and debug mode. `manage.py` keeps
the local default for development; `make demo` names its settings explicitly."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")

from django.core.wsgi import get_wsgi_application

application = get_wsgi_application()
