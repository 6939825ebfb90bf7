"""The run's core: the typed config (`schema`), user errors, THE one assembly path (`build`), the LightningModule
(`module`), THE training step (`step`), loss heads, precision, text data (`corpus`, `data`), one run (`run`) and its
folder (`rundir`), and the text every tool prints (`formatting`)."""
