import pytest
from shop_tasks import app


@pytest.fixture
def exclusive_app():
    """Tell celery-exclusive's plugin which app the test store serves."""
    return app
