pytest_plugins = ("torchlens.testing.pytest_plugin",)  # the torchlens_conformance fixture
