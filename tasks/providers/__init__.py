"""Cloud providers behind one interface (base.Provider): `local` (emulated spot cloud) and `aws`."""
