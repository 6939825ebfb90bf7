"""The run's core: the typed config (`schema`), THE one assembly path (`build`), the LightningModule (`module`), THE
training step (`step`), text data (`corpus`, `data`), one run (`run`) and its folder (`rundir`). The leaves every
layer shares (errors, formatting, loss heads, precision) sit one level up, in `trainer`."""
