"""The Hub side of a model folder: the model card sections every output shares (`card.py`) and the upload
(`push.py`: the card made for the repository, then one commit). Imports nothing heavy."""
