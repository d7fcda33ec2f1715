"""The house's ground floor: the vocabulary (errors, the profile, the model, the catalog, traces)
and leaf utilities (strict input reading, atomic writes, limits, progress). Nothing here imports
any other part of spotfill, so every floor above may use it."""
