(function(){
  var figs = JSON.parse(document.getElementById("tk-figures").textContent);
  var config = JSON.parse(document.getElementById("tk-config").textContent);
  var ids = Object.keys(figs), done = [];
  for (var i = 0; i < ids.length; i++) {
    var f = figs[ids[i]];
    done.push(Plotly.newPlot(ids[i], f.data, f.layout, config));
  }
  Promise.all(done).then(function(){
    document.body.setAttribute("data-charts", String(ids.length));
  });
})();
