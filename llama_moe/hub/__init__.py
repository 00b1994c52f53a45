"""The Hub side of a model folder: the model card sections every output shares (`card.py`) and the upload
(`push.py`: the card made for the repository, then one commit), and `upgrade.py`: a saved folder's code, auto_map
and card brought up to the installed package. Imports nothing heavy."""
