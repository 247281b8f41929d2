import os

from celery import Celery

# Production unless told otherwise, as config/wsgi.py: importing `config` (which every
# entry point does) must not pin the demo's settings before wsgi.py can choose.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")

app = Celery("tollbooth")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
