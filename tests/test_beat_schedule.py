"""Beat's periodic jobs expire when no worker takes them before their next run is due."""

from __future__ import annotations

from django.conf import settings

from config.celery_app import app


def test_every_periodic_job_expires_by_its_next_run():
    for name, entry in settings.CELERY_BEAT_SCHEDULE.items():
        expires = entry["options"]["expires"]
        assert 0 < expires <= float(entry["schedule"]), name


def test_the_celery_app_beat_runs_with_those_expiries():
    # Beat reads its schedule from the app's configuration: the expiry reaches it.
    for name, entry in app.conf.beat_schedule.items():
        assert (
            entry["options"]["expires"] == settings.CELERY_BEAT_SCHEDULE[name]["options"]["expires"]
        ), name
