"""``python/epkit/_details/requirements.py``: the one line that says how to get torch names the supported range
as the installed distribution's metadata writes it (the ``cpu`` extra's torch requirement). The command line
that prints it is ``test_cli.py``'s.
"""


def test_the_torch_message_names_the_supported_range():
    from importlib.metadata import requires

    from epkit._details.requirements import torch_needed

    (torch_req,) = [r.split(";")[0].strip() for r in requires("epkit") if r.startswith("torch") and "cpu" in r]
    assert torch_req.startswith("torch>") or torch_req.startswith("torch=="), torch_req
    assert f"epkit needs {torch_req}," in torch_needed()
